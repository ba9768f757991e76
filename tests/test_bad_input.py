"""Bad input, as a table: every case exits with status 2 and ONE ``error:`` line that names the
field or file at fault, prints no traceback, and leaves what the user had untouched.

The cases run in this process through ``fp8_lightning.cli.main`` (the package is imported once;
the Lightning parser is built per case), so the table stays fast enough for the CPU suite. A
case is ``(id, argv, expected)``: ``expected`` is a substring of the error line (the field or
file it names, and usually what would be valid). ``{tmp}`` in argv is the case's own directory,
``{ckpt}`` a real 10-step quickstart checkpoint, ``{run}`` that run's directory. That run trains
on a small vocabulary, the ``small_vocab`` fixture (each case copies and hashes its checkpoints,
which GPT-2's 50k vocabulary makes 20x larger); ``{small_vocab}`` in argv stands for its
arguments, also in the cases that get as far as the data (none prepares the embedded corpus).
"""

from __future__ import annotations

import hashlib
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from fp8_lightning.cli import main
from tests._runs import bytes_data, small_vocab_fit
from tests.test_security import craft

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["fit", "--config", "configs/quickstart.yaml", "--trainer.default_root_dir", "{tmp}/run"]
FP8 = "--trainer.plugins.init_args."
SMALL_VOCAB = "{small_vocab}"  # the {ckpt} run's data and model (no fit prepares the corpus)


def fit(*args: str) -> list[str]:
    return [*QUICK, *args]


# --------------------------------------------------------------------------- the table
CONFIG = [
    ("unknown-command", ["fitt"], "unknown command 'fitt' (did you mean 'fit'?)"),
    ("unknown-command-valid-list", ["trian"], "valid: fit, validate, test, predict, prepare"),
    ("abbreviated-option", fit("--trainer.max_step", "2"), "--trainer.max_step"),
    ("unknown-option", fit("--trainer.foo", "1"), "--trainer.foo"),
    ("not-an-int", fit("--trainer.max_steps", "abc"), "trainer.max_steps='abc': expected int"),
    ("batch-not-an-int", fit("--data.batch_size", "x"), "data.batch_size='x'"),
    ("config-missing", ["fit", "--config", "{tmp}/nope.yaml"], "nope.yaml"),
    ("config-broken-yaml", ["fit", "--config", "{tmp}/broken.yaml"], "broken.yaml"),
    ("config-unknown-key", ["fit", "--config", "{tmp}/unknown_key.yaml"], "trainer.max_stepz"),
    ("config-not-a-mapping", ["fit", "--config", "{tmp}/list.yaml"], "list.yaml"),
    ("max-steps-negative", fit("--trainer.max_steps", "-5"), "max_steps"),
    ("val-check-negative", fit("--trainer.val_check_interval", "-1"), "val_check_interval"),
    ("devices-zero", fit("--trainer.devices", "0"), "devices"),
    ("precision-beside-plugin", fit("--trainer.precision", "16-mixed"), "trainer.precision"),
    ("accumulate-zero", fit("--trainer.accumulate_grad_batches", "0"),
     "trainer.accumulate_grad_batches=0 must be an integer >= 1"),
    ("log-every-zero", fit("--trainer.log_every_n_steps", "0"), "trainer.log_every_n_steps=0"),
    ("limit-val-negative", fit("--trainer.limit_val_batches", "-1"), "trainer.limit_val_batches=-1"),
    ("limit-val-fraction-over-one", fit("--trainer.limit_val_batches", "1.5"),
     "trainer.limit_val_batches=1.5"),
    ("backend-typo", fit("--model.backend", "tee"), "model.backend='tee': expected one of auto, te, torch"),
    ("attention-typo", fit("--model.attention", "flash"), "model.attention='flash'"),
    ("te-attention-on-torch-backend", fit("--model.attention", "te", "--model.backend", "torch"),
     "model.attention='te'"),
    ("activation-checkpointing-typo", fit("--model.activation_checkpointing", "all"),
     "model.activation_checkpointing='all'"),
    ("activation-checkpointing-every-zero", fit("--model.activation_checkpointing", "full",
                                                "--model.activation_checkpointing_every", "0"),
     "model.activation_checkpointing_every=0"),
    ("learning-rate-zero", fit("--model.learning_rate", "0"), "model.learning_rate=0"),
    ("min-lr-above-lr", fit("--model.min_lr", "1.0"), "model.min_lr=1.0"),
    ("warmup-negative", fit("--model.warmup_steps", "-1"), "model.warmup_steps=-1"),
    ("seed-not-an-int", fit("--seed_everything", "abc"), "seed_everything"),
    ("max-epochs-not-an-int", fit("--trainer.max_epochs", "x"), "trainer.max_epochs"),
    ("gradient-clip-algorithm", fit("--trainer.gradient_clip_algorithm", "l3"), "gradient_clip_algorithm"),
]
FP8_FIELDS = [
    ("recipe-typo", fit(FP8 + "recipe", "curent"), "recipe='curent': expected one of delayed, current"),
    ("margin-negative", fit(FP8 + "recipe", "{name: delayed, margin: -1}"),
     "margin=-1 must be an integer >= 0"),
    ("amax-history-zero", fit(FP8 + "recipe", "{name: delayed, amax_history_len: 0}"),
     "amax_history_len=0 must be an integer >= 1"),
    ("amax-algo-typo", fit(FP8 + "recipe", "{name: delayed, amax_compute_algo: mean}"),
     "amax_compute_algo='mean'"),
    ("format-e5m2", fit(FP8 + "recipe", "{name: delayed, fp8_format: e5m2}"), "fp8_format='e5m2'"),
    ("block-with-hybrid", fit(FP8 + "recipe", "{name: block, fp8_format: hybrid}"),
     "fp8_format='hybrid' with recipe='block'; valid: e4m3"),
    ("margin-with-current", fit(FP8 + "recipe", "{name: current, margin: 1}"),
     "margin is not a field of recipe='current'"),
    ("history-with-block", fit(FP8 + "recipe", "{name: block, amax_history_len: 16}"),
     "amax_history_len is not a field of recipe='block'"),
    ("recipe-without-name", fit(FP8 + "recipe", "{amax_history_len: 16}"),
     "has no name; valid: a mapping with name"),
    ("recipe-field-as-option", fit(FP8 + "amax_history_len", "16"),
     "'amax_history_len' is not an option of FP8Precision (a field of the recipe now: recipe: "
     "{name: delayed, amax_history_len: ...})"),
    ("speedups-option-on-the-plugin", fit(FP8 + "cuda_graphs", "false"),
     "'cuda_graphs' is not an option of FP8Precision (an option of the converter now, for a model "
     "of your own"),
    ("bf16-first-negative", fit(FP8 + "bf16_first_layers", "-1"), "bf16_first_layers=-1"),
    ("bf16-last-negative", fit(FP8 + "bf16_last_layers", "-2"), "bf16_last_layers=-2"),
    ("bf16-first-beyond-model", fit(FP8 + "bf16_first_layers", "5", "--trainer.max_steps", "1",
                                    SMALL_VOCAB),
     "bf16_first_layers=5 is more than the model's 2 blocks"),
    ("weights-fp16", fit(FP8 + "weights", "fp16"), "weights='fp16'"),
    ("on-unavailable-typo", fit(FP8 + "on_unavailable", "crash"), "on_unavailable='crash'"),
    ("removed-interval", ["fit", "--config", "{tmp}/interval.yaml"], "'interval' is not an option of FP8Precision (removed in TransformerEngine 2.x"),
    ("reduce-amax-not-bool", fit(FP8 + "recipe", "{name: delayed, reduce_amax: maybe}"),
     "reduce_amax='maybe'; valid: true, false"),
    # the converter's own options: the whole key path, and what is valid
    ("converter-option-not-bool", fit(FP8 + "converter", "{class_path: fp8_lightning.Speedups, "
                                      "init_args: {cuda_graphs: maybe}}"),
     "trainer.plugins.init_args.converter.init_args.cuda_graphs='maybe': expected true or false "
     "(or null)"),
    ("converter-option-typo", fit(FP8 + "converter", "{class_path: fp8_lightning.Speedups, "
                                  "init_args: {fuse_mlpp: true}}"),
     "trainer.plugins.init_args.converter: 'fuse_mlpp' is not an option of Speedups"),
]
CALLBACKS = [
    ("keep-last-negative", fit("--trainer.callbacks.keep_last", "-1"), "keep_last=-1"),
    ("every-n-negative", fit("--trainer.callbacks.every_n_train_steps", "-1"), "every_n_train_steps"),
    ("guard-window-zero", ["fit", "--config", "{tmp}/guard.yaml"], "NaNGuard"),
    ("fault-ranks-negative", fit("--trainer.callbacks+=fp8_lightning.FaultInjection",
                                 "--trainer.callbacks.ranks", "[-1]"), "ranks"),
    ("callback-class-typo", fit("--trainer.callbacks+=fp8_lightning.NaNGaurd"), "NaNGaurd"),
]
DIMS = [
    ("n-embd-not-16", fit("--model.config.n_embd", "100"), "n_embd=100 is not a multiple of 16"),
    ("n-head-not-dividing", fit("--model.config.n_head", "5"), "n_head=5 does not divide n_embd=64"),
    ("kv-heads-not-dividing", fit("--model.config.n_kv_heads", "3"), "n_kv_heads=3 does not divide n_head=4"),
    ("ffn-not-16", fit("--model.config.ffn_hidden", "100"), "ffn_hidden=100"),
    ("preset-typo", fit("--model.config.name", "gpt5"), "name='gpt5' is not a preset; valid: gpt2"),
    ("block-size-zero", fit("--model.config.block_size", "0"), "block_size=0 must be a positive integer"),
    ("vocab-negative", fit("--model.config.vocab_size", "-1"), "vocab_size=-1"),
    ("norm-typo", fit("--model.config.norm", "batchnorm"), "norm='batchnorm'"),
    ("activation-typo", fit("--model.config.activation", "relu"), "activation='relu'"),
    ("padded-vocab-by-hand", fit("--model.config.padded_vocab_size", "123"), "padded_vocab_size=123"),
    ("layers-zero", fit("--model.config.n_layer", "0"), "n_layer=0"),
    ("head-dim-not-16", fit("--model.config.n_head", "8"), "head dim n_embd/n_head=8"),
    ("batch-zero", fit("--data.batch_size", "0"), "data.batch_size=0"),
    ("workers-negative", fit("--data.num_workers", "-1"), "data.num_workers=-1"),
    ("micro-batch-not-16", fit("--model.config.block_size", "127", "--data.batch_size", "1"),
     "data.batch_size=1 x seq_len=127"),
    ("emulate-ranks-zero", fit("--data.emulate_ranks", "0"), "data.emulate_ranks=0"),
    ("emulate-without-accumulation", fit("--data.emulate_ranks", "2", "--trainer.max_steps", "1",
                                         SMALL_VOCAB),
     "data.emulate_ranks=2 needs trainer.accumulate_grad_batches=2"),
    ("model-vocab-below-data", fit(SMALL_VOCAB, "--model.config.vocab_size", "100",
                                   "--trainer.max_steps", "1"),
     "model.config.vocab_size=100 is smaller than the dataset's tokenizer"),
]
DATA = [
    ("data-dir-missing", fit("--data.data_dir", "{tmp}/nope"), "data.data_dir='{tmp}/nope' does not exist"),
    ("data-dir-not-prepared", fit("--data.data_dir", "{tmp}"), "is not a prepared dataset"),
    ("data-index-broken", fit("--data.data_dir", "{tmp}/ds_bad_index"), "ds_bad_index/train/index.json"),
    ("data-shard-truncated", fit("--data.data_dir", "{tmp}/ds_truncated"), "ds_truncated/train/chunk-0-0.bin"),
    ("data-smaller-than-a-batch", fit("--data.data_dir", "{tmp}/ds", "--data.batch_size", "512"),
     "data.batch_size=512"),
    ("data-ids-outside-vocab", fit("--data.data_dir", "{tmp}/ds_bad_ids", "--trainer.max_steps", "1",
                                   "--trainer.num_sanity_val_steps", "0"), "50303"),
]
PREPARE = [
    ("prepare-no-match", ["prepare", "--inputs", "{tmp}/*.none", "--output_dir", "{tmp}/ds"], "matches no file"),
    ("prepare-csv", ["prepare", "--inputs", "{tmp}/table.csv", "--output_dir", "{tmp}/ds"],
     "is neither .txt nor .jsonl"),
    ("prepare-val-fraction-zero", ["prepare", "--inputs", "{tmp}/small.txt", "--output_dir", "{tmp}/ds",
                                   "--val_fraction", "0"], "val_fraction=0"),
    ("prepare-val-fraction-above-one", ["prepare", "--inputs", "{tmp}/small.txt", "--output_dir",
                                        "{tmp}/ds", "--val_fraction", "1.5"], "val_fraction=1.5"),
    ("prepare-seq-len-zero", ["prepare", "--inputs", "{tmp}/small.txt", "--output_dir", "{tmp}/ds",
                              "--seq_len", "0"], "seq_len=0"),
    ("prepare-workers-zero", ["prepare", "--inputs", "{tmp}/small.txt", "--output_dir", "{tmp}/ds",
                              "--num_workers", "0"], "num_workers=0"),
    ("prepare-unknown-option", ["prepare", "--inputs", "{tmp}/small.txt", "--output", "{tmp}/ds"],
     "--output"),
    ("prepare-missing-output", ["prepare", "--inputs", "{tmp}/small.txt"], "output_dir"),
    ("prepare-not-utf8", ["prepare", "--inputs", "{tmp}/latin1.txt", "--output_dir", "{tmp}/ds2"], "latin1.txt"),
    ("prepare-invalid-jsonl", ["prepare", "--inputs", "{tmp}/broken.jsonl", "--output_dir", "{tmp}/ds2"],
     "broken.jsonl:2"),
    ("prepare-no-text-field", ["prepare", "--inputs", "{tmp}/notext.jsonl", "--output_dir", "{tmp}/ds2"],
     "notext.jsonl:1"),
    ("prepare-tokenizer-missing", ["prepare", "--inputs", "{tmp}/small.txt", "--output_dir", "{tmp}/ds2",
                                   "--tokenizer", "{tmp}/tok.json"], "tok.json"),
    ("prepare-output-is-a-file", ["prepare", "--inputs", "{tmp}/small.txt", "--output_dir",
                                  "{tmp}/table.csv"], "table.csv"),
    ("prepare-too-small", ["prepare", "--inputs", "{tmp}/tiny.txt", "--output_dir", "{tmp}/ds",
                           "--seq_len", "1024"], "seq_len"),
]
CHECKPOINTS = [
    ("ckpt-missing", fit("--ckpt_path", "{tmp}/nope.ckpt"), "checkpoint '{tmp}/nope.ckpt' does not exist"),
    ("ckpt-truncated", fit("--ckpt_path", "{tmp}/truncated.ckpt"), "truncated.ckpt' is truncated or corrupt"),
    ("ckpt-crafted-pickle", fit("--ckpt_path", "{tmp}/evil.ckpt"), "evil.ckpt'"),
    ("ckpt-a-tensor", fit("--ckpt_path", "{tmp}/tensor.ckpt"), "tensor.ckpt' is not a Lightning checkpoint"),
    ("ckpt-a-text-file", fit("--ckpt_path", "{tmp}/notes.txt"),
     "notes.txt' is not a checkpoint written by torch.save (not a zip archive: it starts with b'root'"),
    ("ckpt-other-model", fit(SMALL_VOCAB, "--ckpt_path", "{ckpt}", "--model.config.n_layer", "3"),
     "model.config.n_layer=3 but the checkpoint was trained with n_layer=2"),
    ("ckpt-other-seq-len", fit(SMALL_VOCAB, "--ckpt_path", "{ckpt}", "--data.shuffle", "false"),
     "data.shuffle=False but the checkpoint was trained with True"),
    ("validate-ckpt-missing", ["validate", "--config", "configs/quickstart.yaml", "--ckpt_path",
                               "{tmp}/nope.ckpt"], "nope.ckpt' does not exist"),
    ("checkpoints-dir-missing", ["checkpoints", "{tmp}/nope"], "checkpoint directory '{tmp}/nope' does not exist"),
    ("checkpoints-option-typo", ["checkpoints", "--directoy", "{tmp}"], "--directoy"),
]
SHARDED = [
    ("fsdp-units-zero", fit("--config", "configs/fsdp.yaml", "--trainer.accelerator", "cpu",
                            "--trainer.strategy.init_args.blocks_per_unit", "0"),
     "blocks_per_unit=0; valid: an integer >= 1"),
    ("fsdp-reshard-not-bool", fit("--config", "configs/fsdp.yaml", "--trainer.accelerator", "cpu",
                                  "--trainer.strategy.init_args.reshard_after_forward", "maybe"),
     "reshard_after_forward='maybe': expected true or false (or null)"),
    ("fsdp-param-dtype", fit("--config", "configs/fsdp.yaml", "--trainer.accelerator", "cpu",
                             "--trainer.strategy.init_args.param_dtype", "float16"),
     "param_dtype='float16'; valid: bfloat16, float32"),
    ("fsdp-replicate-not-dividing", fit("--config", "configs/fsdp.yaml", "--trainer.accelerator",
                                        "cpu", "--trainer.devices", "1",
                                        "--trainer.strategy.init_args.replicate", "2"),
     "replicate=2 does not divide the world size 1 (devices x num_nodes); valid: 1"),
    ("consolidate-missing", ["consolidate", "{tmp}/nope.ckpt"], "nope.ckpt' does not exist"),
    ("consolidate-single-file", ["consolidate", "{ckpt}"], "is already a single file"),
    ("consolidate-output-is-dir", ["consolidate", "{tmp}/sharded.ckpt", "{tmp}"], "is a directory"),
    ("sharded-without-metadata", ["consolidate", "{tmp}/no_metadata.ckpt"], "without .metadata"),
    ("sharded-without-meta", ["consolidate", "{tmp}/no_meta.ckpt"], "without meta.pt"),
]
PICKLES = [  # a crafted .metadata in a sharded checkpoint: refused before anything unpickles it
    ("pickle-consolidate", ["consolidate", "{tmp}/crafted.ckpt"], "crafted.ckpt/.metadata"),
    ("pickle-generate", ["generate", "--ckpt", "{tmp}/crafted.ckpt"], "crafted.ckpt/.metadata"),
    ("pickle-fit", fit("--ckpt_path", "{tmp}/crafted.ckpt"), "crafted.ckpt/.metadata"),
    ("pickle-validate", ["validate", "--config", "configs/quickstart.yaml", "--ckpt_path",
                         "{tmp}/crafted.ckpt"], "crafted.ckpt/.metadata"),
    ("pickle-fit-last", ["fit", "--config", "configs/quickstart.yaml", "--trainer.default_root_dir",
                         "{tmp}/crafted_run", "--ckpt_path", "last"], "last.ckpt/.metadata"),
    ("pickle-checkpoints", ["checkpoints", "{tmp}/crafted.ckpt"], "crafted.ckpt/.metadata"),
    ("pickle-single-file", ["generate", "--ckpt", "{tmp}/evil.ckpt"], "evil.ckpt'"),
    ("generate-a-text-file", ["generate", "--ckpt", "{tmp}/notes.txt"],
     "notes.txt' is not a checkpoint written by torch.save"),
    ("unknown-config-field", ["generate", "--ckpt", "{tmp}/future.ckpt"], "future_field"),
    ("resume-last-nothing", fit("--ckpt_path", "last"), "--ckpt_path last: no last.ckpt to resume from in"),
    ("resume-best-nothing", fit("--ckpt_path", "best"), "best"),
]
GENERATE = [
    ("generate-missing", ["generate", "--ckpt", "{tmp}/nope.ckpt"], "nope.ckpt' does not exist"),
    ("generate-tokens-negative", ["generate", "--ckpt", "{ckpt}", "--max_new_tokens", "-1"], "max_new_tokens=-1"),
    ("generate-temperature-negative", ["generate", "--ckpt", "{ckpt}", "--temperature", "-1"], "temperature=-1"),
    ("generate-top-k-zero", ["generate", "--ckpt", "{ckpt}", "--top_k", "0"], "top_k=0"),
    ("generate-device-typo", ["generate", "--ckpt", "{ckpt}", "--device", "tpu"], "device='tpu'"),
    ("generate-tokenizer-missing", ["generate", "--ckpt", "{ckpt}", "--tokenizer", "{tmp}/tok.json"], "tok.json"),
    ("generate-no-ckpt", ["generate", "--prompt", "hi"], "ckpt"),
    ("generate-truncated", ["generate", "--ckpt", "{tmp}/truncated.ckpt"], "truncated.ckpt' is truncated"),
    ("generate-a-tensor", ["generate", "--ckpt", "{tmp}/tensor.ckpt"], "tensor.ckpt' is not a Lightning checkpoint"),
]
COMPARE = [
    ("compare-missing-dir", ["compare", "{tmp}/nope"], "run directory '{tmp}/nope' does not exist"),
    ("compare-no-events", ["compare", "{tmp}"], "no TensorBoard event files under '{tmp}'"),
    ("compare-output-is-dir", ["compare", "{run}", "--output", "{tmp}"], "--output '{tmp}' is a directory"),
    ("compare-nothing", ["compare"], "RUN_DIR"),
    ("compare-label-count", ["compare", "{run}", "--labels", "a", "b"], "2 labels for 1 runs"),
    ("compare-abbreviated", ["compare", "{run}", "--outpu", "x.png"], "--outpu"),
]
TOOLS = [
    ("doctor-config-missing", ["doctor", "--config", "{tmp}/nope.yaml"], "nope.yaml"),
    ("bench-variant-typo", ["bench", "--config", "configs/quickstart.yaml", "--variants", "[fp8-delayd]"],
     "fp8-delayd"),
    ("bench-unknown-option", ["bench", "--variant", "fp8-delayed"], "--variant"),
    ("doctor-unknown-option", ["doctor", "--confg", "x"], "--confg"),
]
TABLE = (CONFIG + FP8_FIELDS + CALLBACKS + DIMS + DATA + PREPARE + CHECKPOINTS + SHARDED + PICKLES
         + GENERATE + COMPARE + TOOLS)


# --------------------------------------------------------------------------- fixtures
class Evil:
    """Unpickling this creates ``marker``: the code-execution probe."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out, _ = small_vocab_fit(tmp_path_factory)
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory, run):
    """The bad files every case may name, made once (cases only read them)."""
    tmp = tmp_path_factory.mktemp("bad-input")
    (tmp / "broken.yaml").write_text("trainer: [unclosed\n")
    (tmp / "unknown_key.yaml").write_text("trainer:\n  max_stepz: 3\n")
    (tmp / "list.yaml").write_text("- fit\n- trainer\n")
    quick = (ROOT / "configs/quickstart.yaml").read_text()
    (tmp / "interval.yaml").write_text(quick.replace("recipe: delayed", "recipe: delayed\n        interval: 1"))
    (tmp / "guard.yaml").write_text(quick.replace("window: 100", "window: 0"))
    (tmp / "table.csv").write_text("a,b\n")
    (tmp / "small.txt").write_text("A small corpus.\n" * 200)
    (tmp / "tiny.txt").write_text("Too short for a block.\n")
    (tmp / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 50)
    (tmp / "broken.jsonl").write_text('{"text": "fine"}\n{"text": "no closing brace"\n')
    (tmp / "notext.jsonl").write_text('{"body": "the text is elsewhere"}\n')
    # The run's prepared dataset (348 val blocks of the quickstart's 129 tokens), broken copies.
    shutil.copytree(bytes_data(tmp_path_factory) / "ds", tmp / "ds")
    for name in ("ds_bad_index", "ds_truncated", "ds_bad_ids"):
        shutil.copytree(tmp / "ds", tmp / name)
    (tmp / "ds_bad_index" / "train" / "index.json").write_text("{not json")
    chunk = tmp / "ds_truncated" / "train" / "chunk-0-0.bin"
    chunk.write_bytes(chunk.read_bytes()[:100])
    chunk = tmp / "ds_bad_ids" / "train" / "chunk-0-0.bin"
    ids = bytearray(chunk.read_bytes())
    body = len(ids) - 12  # after the chunk's 12-byte header: int32 token ids
    bad = (50303).to_bytes(4, "little")
    for i in range(12, 12 + body, 4):
        ids[i:i + 4] = bad
    chunk.write_bytes(bytes(ids))
    ckpt = next(run.rglob("last.ckpt"))
    data = ckpt.read_bytes()
    (tmp / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    torch.save(torch.zeros(3), tmp / "tensor.ckpt")
    (tmp / "notes.txt").write_text("root:x:0:0:root:/root:/bin/bash\n")  # /etc/passwd's kind
    with open(tmp / "evil.ckpt", "wb") as f:
        pickle.dump(Evil(str(tmp / "PWNED")), f)
    for name, keep in (("sharded.ckpt", ("meta.pt", ".metadata")), ("no_metadata.ckpt", ("meta.pt",)),
                       ("no_meta.ckpt", (".metadata",))):
        (tmp / name).mkdir()
        if "meta.pt" in keep:
            torch.save({"pytorch-lightning_version": "2.6.6", "global_step": 1}, tmp / name / "meta.pt")
        if ".metadata" in keep:
            (tmp / name / ".metadata").write_bytes(b"not a pickle")
    crafted = tmp / "crafted.ckpt"
    craft(".metadata", crafted, tmp / "PWNED")
    (tmp / "crafted_run" / "checkpoints").mkdir(parents=True)
    shutil.copytree(crafted, tmp / "crafted_run" / "checkpoints" / "last.ckpt")
    future = torch.load(ckpt, weights_only=True)
    future["hyper_parameters"]["config"]["future_field"] = 1
    torch.save(future, tmp / "future.ckpt")
    return tmp, ckpt


def tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case_id,argv,expected", TABLE, ids=[c[0] for c in TABLE])
def test_bad_input_is_one_error_line_exit_2_and_nothing_lost(case_id, argv, expected, files, run,
                                                             small_vocab, tmp_path, capsys,
                                                             monkeypatch):
    shared, ckpt = files
    monkeypatch.chdir(ROOT)
    for f in shared.iterdir():  # the case's own copy of every bad file
        (shutil.copytree if f.is_dir() else shutil.copy2)(f, tmp_path / f.name)
    subs = {"{tmp}": str(tmp_path), "{ckpt}": str(ckpt), "{run}": str(run)}

    def fill(text: str) -> str:
        for key, value in subs.items():
            text = text.replace(key, value)
        return text

    before = {"ckpt": tree_digest(ckpt.parent), "tmp": tree_digest(tmp_path)}
    with pytest.raises(SystemExit) as exit_info:
        main([b for a in argv for b in (small_vocab if a == SMALL_VOCAB else [fill(a)])])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2, err[-2000:]
    assert len(errors) == 1, err[-2000:]
    assert fill(expected) in errors[0], errors[0]
    assert "Traceback" not in err
    assert len(errors[0]) < 800, errors[0]  # one readable line, not a dump
    # Nothing the user had is lost: every file there before is there, byte for byte.
    assert tree_digest(ckpt.parent) == before["ckpt"]
    after = tree_digest(tmp_path)
    assert {k: v for k, v in after.items() if k in before["tmp"]} == before["tmp"]
    assert not (tmp_path / "PWNED").exists()


def test_the_table_has_every_group_and_over_100_cases():
    assert len(TABLE) >= 100, len(TABLE)
    assert len({c[0] for c in TABLE}) == len(TABLE)  # ids are unique
