"""Custom functions under O1/O4: tell the cast policy which dtype your own functions should run in.

Run:  python examples/custom_functions.py [--opt-level O1]

The cast policy knows torch's functions, not yours. Two ways to fix a function's input dtype:

* `amp.register_half_function(module, "name")` / `register_float_function` / `register_promote_function`,
  called *before* `amp.initialize`: the session patches `module.name` and puts the original back when it closes.
  Call sites must look the function up on the module (`mylib.name(...)`) to see the patch.
* `@amp.half_function` / `@amp.float_function` / `@amp.promote_function` on a function you define.

Both cast only while a cast policy is on (O1, O4); otherwise the function runs as written.
"""

from __future__ import annotations

import argparse
import types

import torch

from ampinit import amp

# A stand-in for a third-party module with two functions the cast lists do not know.
mylib = types.ModuleType("mylib")


def _normalize_rows(x: torch.Tensor) -> torch.Tensor:
    print(f"  mylib.normalize_rows got {x.dtype}")
    return x / x.pow(2).sum(dim=1, keepdim=True).sqrt()  # sums of squares overflow in fp16: wants fp32


def _mix(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    print(f"  mylib.mix got {x.dtype}, {w.dtype}")
    return (x.unsqueeze(-1) * w).sum(dim=1)  # elementwise ops: no cast of their own, safe in half precision


mylib.normalize_rows = _normalize_rows
mylib.mix = _mix


@amp.half_function
def gated(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    print(f"  gated (decorated with half_function) got {x.dtype}, {gate.dtype}")
    return x * torch.sigmoid(gate)


def forward(x: torch.Tensor, w: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    h = linear(x)  # a torch function on the policy's half list
    print(f"  linear returned {h.dtype}")
    h = mylib.normalize_rows(h)
    h = mylib.mix(h, w)
    return gated(h, h)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O1", choices=["O1", "O4"])
    args = parser.parse_args()

    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 8)
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.1)

    amp.register_float_function(mylib, "normalize_rows")
    amp.register_half_function(mylib, "mix")
    linear, optimizer = amp.initialize(linear, optimizer, opt_level=args.opt_level, verbosity=0)
    print(f"under {args.opt_level}:")
    out = forward(x, w, linear)
    print(f"  output {out.dtype}")
    amp.deinitialize()

    restored = mylib.normalize_rows is _normalize_rows and mylib.mix is _mix
    print(f"after amp.deinitialize() (originals restored: {restored}, no policy):")
    forward(x, w, linear)


if __name__ == "__main__":
    main()
