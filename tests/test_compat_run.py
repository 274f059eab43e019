"""``ampinit run``: legacy Apex scripts (examples/legacy_apex) run unchanged, as ``python script.py`` would."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ampinit.cli import main
from tests._device import subprocess_env

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "legacy_apex"
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    # gloo otherwise binds to the interface the hostname resolves to; the tests stay on loopback.
    "GLOO_SOCKET_IFNAME": "lo",
}


def ampinit_run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ampinit", "run", *args],
        capture_output=True,
        text=True,
        env=subprocess_env(ENV),
        timeout=timeout,
    )


def test_run_behaves_like_python(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    (tmp_path / "helper.py").write_text("VALUE = 42\n")
    script.write_text(
        "import sys\nimport helper\nfrom apex import amp\nimport amp_C\n"
        "print(__name__, sys.argv[1:], sys.path[0] == sys.argv[0].rsplit('/', 1)[0], helper.VALUE)\n"
        "print(amp.__name__, amp_C.__name__)\n"
        "sys.exit(3)\n"
    )
    result = ampinit_run(str(script), "--flag", "x", "--help")
    assert result.returncode == 3, result.stderr
    assert result.stdout.splitlines() == [
        "__main__ ['--flag', 'x', '--help'] True 42",
        "ampinit.compat.apex.amp ampinit.compat.apex.amp_C",
    ]


def test_run_releases_what_the_script_left_before_the_interpreter_exits(tmp_path: Path) -> None:
    """A model the script leaves in its globals (a DDP one holds its gloo process group, which aborts the process
    when torch destroys it at interpreter teardown) is released when the script ends, before any exit handler;
    ``python script.py`` would release it only at teardown. The object here lives in a reference cycle, with the
    collector switched off, so that only an explicit collection frees it."""
    script = tmp_path / "leaves_a_cycle.py"
    script.write_text(
        "import atexit, gc, weakref\n"
        "class Holder:\n    pass\n"
        "held = Holder()\nheld.me = held\n"
        "weakref.finalize(held, print, 'released', flush=True)\n"
        "atexit.register(print, 'at exit', flush=True)\n"
        "gc.disable()\n"
    )
    result = ampinit_run(str(script))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["released", "at exit"]


def test_run_names_a_missing_script(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "no_such_script.py"]) == 2
    assert "ampinit run: no such file: 'no_such_script.py'" in capsys.readouterr().err


@pytest.mark.slow
def test_dcgan_three_losses_runs_unchanged() -> None:
    result = ampinit_run(str(EXAMPLES / "main_amp.py"), "--dataset", "fake", "--num_batches", "4", "--opt_level", "O2")
    assert result.returncode == 0, result.stderr
    losses = re.findall(r"Loss_D: ([0-9.]+) Loss_G: ([0-9.]+)", result.stdout)
    assert len(losses) == 4 and all(0 < float(v) < 10 for pair in losses for v in pair)
    state = re.search(r"amp state: (\{.*\})", result.stdout)
    assert state is not None
    assert "'loss_scaler2': {'loss_scale': 65536.0, 'unskipped': 4}" in state.group(1)


def fp32_reference(iterations: int) -> tuple[float, float]:
    """distributed_data_parallel.py's first and final loss, trained in plain fp32 torch (every rank has the same
    data, so it is also what two ranks compute)."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 1024), torch.randn(64, 16)
    model = torch.nn.Linear(1024, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(iterations):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses[0], losses[-1]


def assert_losses_match_fp32(stdout: str, iterations: int) -> None:
    first = float(re.search(r"first loss =\s+([0-9.]+)", stdout).group(1))  # type: ignore[union-attr]
    final = float(re.search(r"final loss =\s+tensor\(([0-9.]+)", stdout).group(1))  # type: ignore[union-attr]
    # O1 runs the Linear in fp16: the loss is the fp32 one to fp16's precision (the final one is printed to 4 places).
    expected_first, expected_final = fp32_reference(iterations)
    assert first == pytest.approx(expected_first, rel=torch.finfo(torch.float16).eps)
    assert final == pytest.approx(expected_final, rel=torch.finfo(torch.float16).eps, abs=5e-5)


@pytest.mark.slow
def test_simple_distributed_runs_unchanged_single_process() -> None:
    result = ampinit_run(str(EXAMPLES / "distributed_data_parallel.py"), "--iterations", "150")
    assert result.returncode == 0, result.stderr
    assert_losses_match_fp32(result.stdout, 150)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_simple_distributed_runs_unchanged_on_two_processes() -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        "-m", "ampinit", "run", str(EXAMPLES / "distributed_data_parallel.py"), "--iterations", "50",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=subprocess_env(ENV), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert_losses_match_fp32(result.stdout, 50)
    assert "delay_allreduce" not in result.stderr  # honoured (find_unused_parameters=True), nothing to explain


def test_run_takes_a_directory_with_main_as_python_does(tmp_path: Path) -> None:
    """``ampinit run`` promises to run a script "as ``python SCRIPT ARGS...`` would"; ``python DIR`` runs
    ``DIR/__main__.py`` with ``sys.path[0] == DIR``, but ``ampinit run DIR`` answered "no such file: 'DIR'" (exit 2)
    for a path that exists.

    Found by: the review of the distributed layer and the command-line tools.
    """
    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text("import sys\nprint('argv', sys.argv, 'path0', sys.path[0])\n", encoding="utf-8")
    command = [sys.executable, "-m", "ampinit", "run", str(app), "a"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"argv [{str(app)!r}, 'a'] path0 {app}" in result.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    result = subprocess.run([*command[:4], str(empty)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 2 and f"can't find '__main__' module in {str(empty)!r}" in result.stderr


def test_run_gives_main_the_absolute_path_of_the_script_as_python_does(tmp_path: Path) -> None:
    """``python train.py`` sets ``__file__`` to the script's absolute path (Python 3.9+), and ``sys.argv[0]`` to the
    path as typed; ``ampinit run train.py`` set ``__file__`` to ``'train.py'``, so a script that changed directory
    and then opened a file beside itself (``os.path.dirname(os.path.abspath(__file__))``) failed.

    Found by: the audit of the command line.
    """
    (tmp_path / "config.txt").write_text("lr=0.1\n", encoding="utf-8")
    elsewhere = tmp_path / "out"
    elsewhere.mkdir()
    (tmp_path / "train.py").write_text(
        "import os, sys\n"
        f"os.chdir({str(elsewhere)!r})\n"
        "here = os.path.dirname(os.path.abspath(__file__))\n"
        "config = open(os.path.join(here, 'config.txt')).read()\n"
        "print(sys.argv[0], __file__ == os.path.join(here, 'train.py'), config)\n",
        encoding="utf-8",
    )
    command = [sys.executable, "-m", "ampinit", "run", "train.py"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["train.py", "True", "lr=0.1"]


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_run_aliases_reach_spawned_and_forkserver_children(tmp_path: Path, method: str) -> None:
    """A process started with the "spawn" start method (macOS' and Windows' default, ``torch.multiprocessing.spawn``,
    ``DataLoader(multiprocessing_context="spawn")``) or "forkserver" (Python 3.14's default on Linux) is a fresh
    interpreter that re-imports the script: its ``from apex import amp`` raised ModuleNotFoundError there, since
    only the parent of ``ampinit run`` had the aliases, and the child exited with status 1.

    Found by: the audit of the command line.
    """
    script = tmp_path / "workers.py"
    script.write_text(
        "import multiprocessing as mp\nimport sys\nfrom apex import amp\n\n"
        "def work(queue):\n    queue.put(amp.__name__)\n\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context(sys.argv[1])\n"
        "    queue = ctx.Queue()\n"
        "    process = ctx.Process(target=work, args=(queue,))\n"
        "    process.start()\n    process.join()\n"
        "    print('exit code', process.exitcode)\n"
        "    print(queue.get(timeout=60) if process.exitcode == 0 else 'none')\n",
        encoding="utf-8",
    )
    result = ampinit_run(str(script), method, timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["exit code 0", "ampinit.compat.apex.amp"], result.stderr
