"""Where vLLM's served adapters are written (generation/vllm_lora.py `adapter_root`): one
folder per engine, named for its process; folders of processes that died without closing
their engine are deleted when the next engine starts; /dev/shm only with room to spare."""

import os
import subprocess
import sys

from torchtitan_rl.generation import vllm_lora
from torchtitan_rl.generation.vllm_lora import adapter_root


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_dead_process_folder_is_deleted_and_a_live_one_kept(tmp_path):
    dead = tmp_path / f"vllm_lora_{_dead_pid()}_abc"
    live = tmp_path / f"vllm_lora_{os.getppid()}_def"
    other = tmp_path / "vllm_lora_notapid_x"
    for folder in (dead, live, other):
        (folder / "v1").mkdir(parents=True)
    root = adapter_root(str(tmp_path))
    assert not dead.exists()
    assert live.exists() and other.exists()
    assert os.path.basename(root).startswith(f"vllm_lora_{os.getpid()}_")
    assert adapter_root(str(tmp_path)) != root and os.path.isdir(root)  # ours stays


def test_dev_shm_is_used_only_with_room_to_spare(monkeypatch, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(vllm_lora, "SHM", str(shm))
    monkeypatch.setattr(vllm_lora.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(vllm_lora, "SHM_MIN_FREE_BYTES", 0)
    assert os.path.dirname(adapter_root()) == str(shm)
    monkeypatch.setattr(vllm_lora, "SHM_MIN_FREE_BYTES", 1 << 62)  # more than any disk
    assert os.path.dirname(adapter_root()) == str(tmp_path / "tmp")
