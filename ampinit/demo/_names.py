"""The demo's task names, apart from the tasks themselves (which import torch), for the command line's parsers."""

TASKS: tuple[str, ...] = ("checkerboard", "mlp")
