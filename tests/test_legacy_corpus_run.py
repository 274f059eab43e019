"""Corpus scripts run end to end on the CPU: the original under ``ampinit run``, and each migration that the
codemod makes (``--to ampinit``, and ``--to torch`` where it migrates) with plain ``python``, against an fp32 run
of the same script.

What is changed in a script before it runs, the same for every run of it, is listed with it: tiny synthetic data
in place of the dataset, the CPU in place of a hard-coded CUDA device, and where a script imports modules of its
own project that the corpus does not hold, tiny stand-ins for them (data, and a model of the same interface).
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import ampinit
from ampinit import _registry
from ampinit.cli import run_script
from ampinit.compat import apex
from ampinit.migrate import migrate_source
from ampinit.migrate._resolve import imported_modules

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "legacy_corpus"

TORCHVISION = {
    "torchvision/__init__.py": "",
    "torchvision/datasets.py": '''
import torch


class FakeData(torch.utils.data.Dataset):
    """Four random 3x64x64 images (the data-loading stand-in)."""

    def __init__(self, image_size, transform=None):
        gen = torch.Generator().manual_seed(0)
        self.images = torch.rand(4, 3, 64, 64, generator=gen)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        return self.images[index], 0
''',
    "torchvision/transforms.py": "def ToTensor():\n    return None\n",
    "torchvision/utils.py": "def save_image(*args, **kwargs):\n    pass\n",
}

WAVEGLOW_PROJECT = {
    "mel2samp.py": '''
import torch


class Mel2Samp(torch.utils.data.Dataset):
    """Eight random (mel, audio) pairs (the data-loading stand-in)."""

    def __init__(self, **config):
        gen = torch.Generator().manual_seed(0)
        self.mel = torch.randn(8, 4, 6, generator=gen)
        self.audio = torch.randn(8, 24, generator=gen)

    def __len__(self):
        return len(self.mel)

    def __getitem__(self, index):
        return self.mel[index], self.audio[index]
''',
    "glow.py": '''
import torch


class WaveGlow(torch.nn.Module):
    """A model with WaveGlow's interface: (mel, audio) -> outputs for WaveGlowLoss."""

    def __init__(self, **config):
        super().__init__()
        self.mel = torch.nn.Linear(24, 24)
        self.audio = torch.nn.Linear(24, 24)

    def forward(self, forward_input):
        mel, audio = forward_input
        return self.mel(mel.flatten(1)) + self.audio(audio)


class WaveGlowLoss(torch.nn.Module):
    def __init__(self, sigma):
        super().__init__()
        self.sigma = sigma

    def forward(self, outputs):
        return (outputs * outputs).mean() / (2 * self.sigma * self.sigma)
''',
    "distributed.py": """
def init_distributed(*args, **kwargs):
    raise RuntimeError("single process only")


def apply_gradient_allreduce(model):
    return model


def reduce_tensor(tensor, num_gpus):
    return tensor
""",
}

TACOTRON2_PROJECT = {
    "distributed.py": "def apply_gradient_allreduce(model):\n    return model\n",
    "model.py": '''
import torch


class Attention(torch.nn.Module):
    score_mask_value = -float("inf")


class Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_layer = Attention()


class Tacotron2(torch.nn.Module):
    """A model with Tacotron2's interface (parse_batch, forward, decoder.attention_layer)."""

    def __init__(self, hparams):
        super().__init__()
        self.decoder = Decoder()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 6))

    def parse_batch(self, batch):
        text, mel = batch
        return text, mel

    def forward(self, x):
        return self.net(x)


def load_model(hparams):
    return Tacotron2(hparams)
''',
    "data_utils.py": '''
import torch


class TextMelLoader(torch.utils.data.Dataset):
    """Sixteen random (text, mel) pairs (the data-loading stand-in)."""

    def __init__(self, files, hparams, speaker_ids=None):
        gen = torch.Generator().manual_seed(0)
        self.speaker_ids = speaker_ids or {}
        self.text = torch.randn(16, 8, generator=gen)
        self.mel = torch.randn(16, 6, generator=gen)

    def __len__(self):
        return len(self.text)

    def __getitem__(self, index):
        return self.text[index], self.mel[index]


class TextMelCollate:
    def __init__(self, n_frames_per_step):
        pass

    def __call__(self, batch):
        return torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
''',
    "loss_function.py": """
import torch


class Tacotron2Loss(torch.nn.Module):
    def forward(self, y_pred, y):
        return torch.nn.functional.mse_loss(y_pred, y)
""",
    "logger.py": """
class Tacotron2Logger:
    def __init__(self, logdir):
        pass

    def log_training(self, *args):
        pass

    def log_validation(self, *args):
        pass
""",
    "hparams.py": """
from types import SimpleNamespace


def create_hparams(hparams_string=None):
    values = dict(
        fp16_run=True, distributed_run=False, cudnn_enabled=True, cudnn_benchmark=False, dynamic_loss_scaling=True,
        seed=1234, learning_rate=1e-2, weight_decay=1e-6, epochs=2, batch_size=4, grad_clip_thresh=1.0,
        iters_per_checkpoint=1000, use_saved_learning_rate=False, ignore_layers=[], training_files="",
        validation_files="", n_frames_per_step=1, dist_backend="gloo", dist_url="", learning_rate_min=1e-5,
        learning_rate_anneal=1000,
    )
    for item in (hparams_string or "").split(","):
        if item:
            key, value = item.split("=")
            values[key] = value == "True"
    return SimpleNamespace(**values)
""",
}

WAVEGLOW_CONFIG = """{
 "train_config": {"fp16_run": FP16, "output_directory": "checkpoints", "epochs": 2, "learning_rate": 1e-2,
                  "sigma": 1.0, "iters_per_checkpoint": 1000, "batch_size": 4, "seed": 1234, "checkpoint_path": "",
                  "with_tensorboard": false},
 "data_config": {}, "dist_config": {}, "waveglow_config": {}
}"""


@dataclass(frozen=True)
class Script:
    """A corpus file, how to run it, how to read its losses, and what is changed before it runs (with why)."""

    name: str
    args: tuple[str, ...]
    losses: str  # a regex whose groups are the losses of one step
    patches: tuple[tuple[str, str, str], ...] = ()  # (old, new, why)
    files: dict[str, str] = field(default_factory=dict)
    fp32: tuple[str, str] = ("", "")  # the change that makes the run fp32 (the reference)
    directions: tuple[str, ...] = ("ampinit", "torch")
    tolerance: float = 2e-2


SCRIPTS = {
    "simple_ddp": Script(
        "apex__examples_simple_distributed_distributed_data_parallel.py.txt",
        (),
        r"final loss =\s+tensor\(([0-9.]+)",
        patches=(
            ("device='cuda'", "device='cpu'", "the CPU in place of CUDA"),
            ("torch.nn.Linear(D_in, D_out).cuda()", "torch.nn.Linear(D_in, D_out)", "the CPU in place of CUDA"),
            ("range(500)", "range(40)", "fewer steps"),
            ("N, D_in, D_out = 64, 1024, 16", "torch.manual_seed(0)\nN, D_in, D_out = 64, 256, 16", "a seed, a size"),
        ),
        fp32=('opt_level="O1"', 'opt_level="O0"'),
    ),
    "dcgan": Script(
        "apex__examples_dcgan_main_amp.py.txt",
        (
            "--dataset",
            "fake",
            "--batchSize",
            "2",
            "--imageSize",
            "64",
            "--niter",
            "1",
            "--nz",
            "8",
            "--ngf",
            "4",
            "--ndf",
            "4",
            "--workers",
            "0",
            "--outf",
            "out",
        ),
        r"Loss_D: ([0-9.]+) Loss_G: ([0-9.]+)",
        patches=(
            ('torch.device("cuda:0")', 'torch.device("cpu")', "the CPU in place of CUDA"),
            ("real_label = 1\n", "real_label = 1.0\n", "torch.full gives a float label (modern torch: a long one)"),
            ("fake_label = 0\n", "fake_label = 0.0\n", "the same"),
        ),
        files=TORCHVISION,
        fp32=("'--opt_level', default='O1'", "'--opt_level', default='O0'"),
        directions=("ampinit",),
    ),
    "waveglow": Script(
        "waveglow__train.py.txt",
        ("-c", "config.json"),
        r"^\d+:\t([0-9.]+)$",
        patches=(
            ("WaveGlow(**waveglow_config).cuda()", "WaveGlow(**waveglow_config)", "the CPU in place of CUDA"),
            ("Variable(mel.cuda())", "Variable(mel)", "the CPU in place of CUDA"),
            ("Variable(audio.cuda())", "Variable(audio)", "the CPU in place of CUDA"),
        ),
        files={**WAVEGLOW_PROJECT, "config.json": WAVEGLOW_CONFIG.replace("FP16", "true")},
        fp32=('"fp16_run": true', '"fp16_run": false'),
    ),
    "tacotron2": Script(
        "tacotron2__train.py.txt",
        ("-o", "out", "-l", "logs", "--hparams", "fp16_run=True"),
        r"Train loss \d+ ([0-9.]+) Grad Norm",
        patches=(("model = Tacotron2(hparams).cuda()", "model = Tacotron2(hparams)", "the CPU in place of CUDA"),),
        files=TACOTRON2_PROJECT,
        fp32=("fp16_run=True", "fp16_run=False"),
        directions=("ampinit",),
    ),
    "mellotron": Script(
        "mellotron__train.py.txt",
        ("-o", "out", "-l", "logs", "--hparams", "fp16_run=True"),
        r"Train loss \d+ ([0-9.]+) Grad Norm",
        files=TACOTRON2_PROJECT,
        fp32=("fp16_run=True", "fp16_run=False"),
        directions=("ampinit",),
    ),
}


def _patched(source: str, script: Script) -> str:
    for old, new, _why in script.patches:
        assert old in source, old
        source = source.replace(old, new)
    return source


def _run(
    tmp: Path, source: str, script: Script, aliases: bool, monkeypatch: pytest.MonkeyPatch, fp32: bool = False
) -> list[tuple[float, ...]]:
    """Run ``source`` as ``__main__`` in a fresh directory, in this process (a subprocess per run costs seconds of
    imports): under ``ampinit run`` when ``aliases``, else as plain ``python`` would. Returns the printed losses."""
    tmp.mkdir()
    for path, text in script.files.items():
        if fp32 and script.fp32[0] in text:
            text = text.replace(*script.fp32)
        (tmp / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp / path).write_text(text, encoding="utf-8")
    if fp32 and script.fp32[0] in source:
        source = source.replace(*script.fp32)
    (tmp / "train.py").write_text(source, encoding="utf-8")
    args = [a.replace(*script.fp32) if fp32 else a for a in script.args]
    own = {Path(p).parts[0].removesuffix(".py") for p in script.files}
    out = io.StringIO()
    with monkeypatch.context() as patch:
        patch.chdir(tmp)
        patch.setattr(sys, "argv", ["train.py", *args])
        patch.setattr(sys, "path", [str(tmp), *sys.path])
        patch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
        patch.setattr(torch.backends.cudnn, "enabled", torch.backends.cudnn.enabled)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny convolutions: threads only contend (seconds per step on a busy machine)
        try:
            with contextlib.redirect_stdout(out), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.manual_seed(0)
                if aliases:
                    assert run_script("train.py", args) == 0
                else:
                    runpy.run_path("train.py", run_name="__main__")
        finally:
            torch.set_num_threads(threads)
            apex.uninstall()
            while _registry.current() is not None:
                ampinit.deinitialize()
            for name in [n for n in sys.modules if n.split(".")[0] in own]:
                del sys.modules[name]
    found = [tuple(float(v) for v in m.groups()) for m in re.finditer(script.losses, out.getvalue(), re.MULTILINE)]
    assert found, out.getvalue()[-2000:]
    return found


def _close(got: list[tuple[float, ...]], want: list[tuple[float, ...]], tolerance: float) -> bool:
    return len(got) == len(want) and all(
        abs(a - b) <= tolerance * max(1.0, abs(b)) for g, w in zip(got, want) for a, b in zip(g, w)
    )


# On a pretended GPU machine: the scripts are patched onto the CPU, and nothing may take CUDA's presence for
# the device they train on (a migrated file's autocast device included).
@pytest.mark.usefixtures("pretend_gpu")
@pytest.mark.parametrize("key", sorted(SCRIPTS))
def test_corpus_script_runs_under_ampinit_run_and_after_migration(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first loss of the mixed-precision run is the fp32 run's (the first forward under amp, before any
    update), and every migration
    trains like the original under ``ampinit run``, step for step (the same skipped steps included)."""
    script = SCRIPTS[key]
    original = _patched((CORPUS / script.name).read_text(encoding="utf-8"), script)
    fp32 = _run(tmp_path / "fp32", original, script, True, monkeypatch, fp32=True)
    under_run = _run(tmp_path / "run", original, script, True, monkeypatch)
    assert _close([under_run[0][:1]], [fp32[0][:1]], script.tolerance), (under_run, fp32)
    for to in ("ampinit", "torch"):
        result = migrate_source(original, to)  # type: ignore[arg-type]
        if to not in script.directions:
            assert result.refused, f"--to {to} migrates {key}: add the direction here"
            continue
        assert result.changed and not result.refused and not result.needs_human, [s.render() for s in result.sites]
        if to == "torch":
            roots = {module.split(".")[0] for _, module in imported_modules(result.migrated)}
            assert not roots & {"apex", "ampinit"}, roots
        migrated = _run(tmp_path / to, result.migrated, script, False, monkeypatch)
        assert _close(migrated, under_run, script.tolerance), (to, migrated, under_run)
