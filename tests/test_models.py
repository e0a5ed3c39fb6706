"""Architecture names found without importing open_clip (fastclip.models.find_arch): the same configs as its
registry, so that `fastclip train --check` (and the launcher's check before torchrun) skips an import of 8-10 s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fastclip.compat import import_open_clip
from fastclip.models import REPO_MODEL_CONFIGS, find_arch, open_clip_config, resolve_arch

from helpers import EMBEDDED, clean_env, make_embedded, overrides


def test_open_clips_configs_read_from_its_package_equal_its_registry(monkeypatch):
    open_clip = import_open_clip()
    factory = sys.modules["open_clip.factory"]
    # open_clip's own scan of its package alone (other tests in this process register configs at run time)
    monkeypatch.setattr(factory, "_MODEL_CONFIG_PATHS", [Path(factory.__file__).parent / "model_configs"])
    monkeypatch.setattr(factory, "_MODEL_CONFIGS", {})
    factory._rescan_model_configs()
    names = open_clip.list_models()
    registry = {n: open_clip.get_model_config(n) for n in names}
    monkeypatch.delitem(sys.modules, "open_clip")  # as in a process that has not imported it
    assert len(names) > 100 and {n: open_clip_config(n) for n in names} == registry
    assert open_clip_config("tiny-vit") is None and open_clip_config("no-such-arch") is None
    assert find_arch("ViT-B-32") == ("ViT-B-32", None, registry["ViT-B-32"])
    name, path, config = find_arch("tiny-vit")
    assert (name, path) == ("tiny-vit", REPO_MODEL_CONFIGS / "tiny-vit.json") and config["embed_dim"] > 0
    with pytest.raises(ValueError, match="unknown model architecture 'ViT-X'"):
        find_arch("ViT-X")
    with pytest.raises(FileNotFoundError, match="model config file not found: nowhere.json"):
        find_arch("nowhere.json")


def test_a_config_added_to_open_clip_at_run_time_resolves_as_before(tmp_path):
    """A user's own loop may register a config with open_clip and then name it: the registry, once imported, counts."""
    open_clip = import_open_clip()
    config = open_clip.get_model_config("RN50")
    (tmp_path / "my-rn50.json").write_text(json.dumps(config))
    open_clip.add_model_config(str(tmp_path / "my-rn50.json"))
    assert resolve_arch("my-rn50") == ("my-rn50", None)


def test_the_check_before_a_launch_does_not_import_open_clip_nor_open_clip_wandb(tmp_path):
    data = make_embedded(tmp_path / "data")
    checks = [
        ["train", "--check", "--world-size", "2", "--config", str(EMBEDDED), *overrides(data, tmp_path / "r", **extra)]
        for extra in ({}, {"model.arch": "tiny-vit-hf"}, {"model.arch": "RN50"})
    ]
    # then open_clip's import, which leaves wandb unimported (timm would import it, for nothing of open_clip's),
    # and a real `import wandb` after it for train.wandb, when wandb is installed
    script = (
        "import importlib.util, sys; from fastclip.cli import main\n"
        f"codes = [main(argv) for argv in {checks!r}]\n"
        "print(codes, 'open_clip' in sys.modules)\n"
        "from fastclip.compat import import_open_clip; import_open_clip()\n"
        "installed = importlib.util.find_spec('wandb') is not None\n"
        "print('wandb' in sys.modules, not installed or callable(__import__('wandb').init))"
    )
    out = subprocess.run([sys.executable, "-c", script], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-2:] == ["[0, 0, 0] False", "False True"], out.stdout + out.stderr
    assert out.stdout.count("config ok for 2 process(es)") == 3
