"""No code runs from a checkpoint.

A checkpoint is data. Every command that reads one (``consolidate``, ``generate``, ``fit`` and
``validate`` with ``--ckpt_path PATH`` or ``last``, ``checkpoints``) unpickles its files only
through allow-listing loaders: a crafted file is refused with one ``error:`` line naming the file
and the reason (exit status 2), before any training starts, and the code it carries never runs.

The crafted files: a sharded checkpoint's DCP ``.metadata`` (torch's own reader unpickles it with
plain ``pickle``), its ``meta.pt``, a non-tensor entry of its shards (torch's default planner
unpickles those with ``weights_only=False``), and a single-file ``.ckpt``. Each carries a pickle
whose ``__reduce__`` would create a marker file.
"""

import io
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from fp8_lightning.checkpoint_files import (CheckpointError, MetadataUnpickler, consolidate_checkpoint,
                                      read_dcp_metadata, safe_lightning_dcp_loads)
from fp8_lightning.config import GPTConfig
from tests._runs import run_main

ROOT = Path(__file__).resolve().parents[1]


class Payload:
    """Unpickling this runs ``touch MARKER`` (pickled as the global ``posix.system``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def lightning_meta(**extra):
    config = GPTConfig(name="tiny").to_dict()
    return {"pytorch-lightning_version": "2.6.0", "global_step": 3, "tokens_seen": 0,
            "hyper_parameters": {"config": config},
            "fp8_lightning": {"config": config, "precision": "bf16", "val_loss": None}, **extra}


def sharded_checkpoint(path: Path, **state) -> Path:
    """A sharded checkpoint as FSDP2Strategy writes it: DCP shards plus Lightning's meta.pt."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, on purpose
        warnings.simplefilter("ignore")
        dcp.save({"state_dict": {"model.wte.weight": torch.ones(4, 4)}, **state},
                 checkpoint_id=path, no_dist=True)
    torch.save(lightning_meta(), path / "meta.pt")
    return path


def craft(kind: str, path: Path, marker: Path) -> str:
    """A checkpoint at ``path`` whose file ``kind`` carries the payload; the file's path."""
    if kind == "single-file":
        torch.save({"state_dict": {}, **lightning_meta(callbacks={"x": Payload(marker)})}, path)
        return str(path)
    if kind == "shard entry":  # .metadata and meta.pt are genuine; a non-tensor entry is not
        sharded_checkpoint(path, extra=Payload(marker))
        return f"{path} (its shards' entry extra)"
    sharded_checkpoint(path)
    if kind == ".metadata":  # genuine metadata with the payload hidden in its planner data
        with open(path / ".metadata", "rb") as f:
            metadata = pickle.load(f)  # written just above by torch: trusted
        metadata.planner_data["x"] = Payload(marker)
        (path / ".metadata").write_bytes(pickle.dumps(metadata))
    elif kind == "meta.pt":
        torch.save(lightning_meta(loops=Payload(marker)), path / "meta.pt")
    return str(path / kind)


def commands(ckpt: Path, root: Path) -> dict[str, list[str]]:
    quickstart = ["--config", "configs/quickstart.yaml", "--trainer.default_root_dir", str(root)]
    return {
        "consolidate": ["consolidate", str(ckpt)],
        "generate": ["generate", "--ckpt", str(ckpt), "--device", "cpu", "--max_new_tokens", "1"],
        "fit": ["fit", *quickstart, "--ckpt_path", str(ckpt)],
        "fit last": ["fit", *quickstart, "--ckpt_path", "last"],
        "validate": ["validate", *quickstart, "--ckpt_path", str(ckpt)],
        "checkpoints": ["checkpoints", str(ckpt)],
    }




def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("command", ["consolidate", "generate", "fit", "fit last", "validate",
                                     "checkpoints"])
@pytest.mark.parametrize("kind", [".metadata", "meta.pt", "single-file"])
def test_a_crafted_checkpoint_is_refused_by_every_command_and_runs_nothing(
        kind, command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    marker, root = tmp_path / "PWNED", tmp_path / "run"
    ckpt = root / "checkpoints" / "last.ckpt"  # where `--ckpt_path last` looks
    ckpt.parent.mkdir(parents=True)
    crafted = craft(kind, ckpt, marker)
    before = files_under(root)

    code, out, err = run_main(capsys, commands(ckpt, root)[command])

    assert not marker.exists(), "the checkpoint ran code"
    assert code == 2, (out, err)
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    message = err[err.index(line):]  # a ConfigError lists its problems on the following lines
    if command == "consolidate" and kind == "single-file":
        assert "is already a single file" in message  # nothing to consolidate: never loaded
    else:
        assert repr(crafted) in message and "refusing to unpickle it" in message, message
        assert "GLOBAL posix.system" in message or "GLOBAL nt.system" in message
    assert files_under(root) == before  # refused before anything ran: no training, no writes


def test_a_crafted_shard_entry_is_refused_where_the_shards_are_read(tmp_path, capsys,
                                                                    monkeypatch):
    """Its .metadata and meta.pt are genuine, so the checks before loading pass; the shards are
    read (consolidate, generate, and Lightning's restore) with the allow-listed planner."""
    monkeypatch.chdir(ROOT)
    marker, root = tmp_path / "PWNED", tmp_path / "run"
    ckpt = root / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    crafted = craft("shard entry", ckpt, marker)
    argvs = commands(ckpt, root)
    for command in ("consolidate", "generate"):
        code, out, err = run_main(capsys, argvs[command])
        assert not marker.exists(), f"{command}: the checkpoint ran code"
        assert code == 2 and "Traceback" not in err, (command, out, err)
        assert len([x for x in err.splitlines() if x.startswith("error:")]) == 1, err
        assert repr(crafted) in err and "refusing to unpickle it" in err, err
    with pytest.raises(CheckpointError, match="GLOBAL posix.system.*refusing to unpickle"):
        consolidate_checkpoint(ckpt)  # what `fit --ckpt_path` restores through (one GPU, DDP)
    assert not marker.exists()
    # `checkpoints` reads meta.pt and .metadata only: it lists the checkpoint
    code, out, err = run_main(capsys, argvs["checkpoints"])
    assert code == 0 and "last.ckpt/" in out and not marker.exists()


def test_fsdp_restores_read_the_shards_through_the_allow_listing_reader(tmp_path):
    """FSDP2Strategy.load_checkpoint runs Lightning's sharded load inside
    safe_lightning_dcp_loads(): a crafted .metadata or shard entry is refused there too (in case
    the directory changed after the check before loading), and a genuine one loads."""
    from lightning.fabric.strategies import model_parallel

    marker = tmp_path / "PWNED"
    for kind in (".metadata", "shard entry"):
        ckpt = tmp_path / kind.replace(" ", "-")
        craft(kind, ckpt, marker)
        state = {"state_dict": {"model.wte.weight": torch.zeros(4, 4)}, "extra": None}
        with safe_lightning_dcp_loads(), pytest.raises(CheckpointError,
                                                       match="refusing to unpickle"):
            model_parallel._distributed_checkpoint_load(state, ckpt)
        assert not marker.exists(), kind
    genuine = sharded_checkpoint(tmp_path / "genuine")
    state = {"state_dict": {"model.wte.weight": torch.zeros(4, 4)}}
    with safe_lightning_dcp_loads():
        model_parallel._distributed_checkpoint_load(state, genuine)
    assert torch.equal(state["state_dict"]["model.wte.weight"], torch.ones(4, 4))
    assert model_parallel._distributed_checkpoint_load.__module__ == \
        "lightning.fabric.strategies.fsdp"  # restored afterwards


def test_metadata_unpickler_allows_what_torch_writes_and_nothing_else(tmp_path):
    genuine = sharded_checkpoint(tmp_path / "genuine.ckpt",
                                 optimizer_0={"param_groups": [{"lr": 0.1, "betas": (0.9, 0.95)}],
                                              "state": {0: {"step": torch.tensor(3.0)}}},
                                 bf16=torch.zeros(2, dtype=torch.bfloat16))
    metadata = read_dcp_metadata(genuine)
    assert "state_dict.model.wte.weight" in metadata.state_dict_metadata
    # Exact names only: a method reached through an allowed class is not that class.
    unpickler = MetadataUnpickler(io.BytesIO())
    for module, name in [("pathlib", "Path.touch"), ("builtins", "eval"), ("torch", "load"),
                         ("torch.serialization", "load"), ("os", "system")]:
        with pytest.raises(pickle.UnpicklingError, match=f"GLOBAL {module}.{name}"):
            unpickler.find_class(module, name)
    assert unpickler.find_class("torch", "bfloat16") is torch.bfloat16


def test_a_shard_name_leading_outside_the_checkpoint_is_refused(tmp_path):
    ckpt = sharded_checkpoint(tmp_path / "last.ckpt")
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="names a shard outside its directory"):
        consolidate_checkpoint(ckpt)
