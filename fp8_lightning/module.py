"""``GPTLightningModule``: the training recipe around :class:`~fp8_lightning.model.GPT`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchmetrics import MeanMetric
from typing_extensions import override

from .checkpoint_files import CheckpointError, checkpoint_versions
from .config import ConfigError, GPTConfig
from .distributed import AgreedStop, full_tensor, is_sharded
from .fast_path import FastPath, plan_compile
from .fast_path_runner import FastPathRunner
from .fp8.plugin import fp8_plugin
from .memory_check import check_memory, is_gpu_fit, run_shape
from .model import ACTIVATION_CHECKPOINTING, GPT, checkpointed_blocks
from .resume import check_same_model, rng_state, set_rng_state
from .te_availability import te_status

if TYPE_CHECKING:
    from .memory import RunShape


def resolve_backend(backend: str) -> tuple[str, str]:
    """``auto`` -> ``te`` when TransformerEngine can run here, else ``torch``; with the reason."""
    if backend not in ("auto", "te", "torch"):
        raise ConfigError([f"model.backend={backend!r}; valid: auto, te, torch"], "model")
    ok, reason = te_status()
    if backend == "auto":
        return ("te", reason) if ok else ("torch", reason)
    if backend == "te" and not ok:
        raise ConfigError([f"model.backend='te' but {reason}; use backend: auto (falls back to "
                           "the PyTorch backend) or torch"], "model")
    return backend, reason


def lr_at(step: int, *, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Linear warm-up to ``max_lr``, then cosine decay to ``min_lr`` at ``decay_steps``."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def takes_grad_scale(optimizer: torch.optim.Optimizer, params: Any) -> bool:
    """Does ``optimizer`` divide the gradients by its ``grad_scale`` in the update: torch's fused
    Adam/AdamW on plain tensors (FSDP's DTensor parameters keep the separate clip)."""
    from torch.distributed.tensor import DTensor

    return (isinstance(optimizer, torch.optim.Adam) and bool(optimizer.defaults.get("fused"))
            and not any(isinstance(p, DTensor) for p in params))


class GPTLightningModule(L.LightningModule):
    """Trains a GPT with next-token cross-entropy.

    Args:
        config: the model (a preset ``name`` plus any field overrides).
        backend: ``auto`` (TransformerEngine when it can run, else PyTorch), ``te`` or ``torch``.
        attention: ``sdpa`` (``F.scaled_dot_product_attention``) or ``te``
            (``te.DotProductAttention``, TE backend only).
        learning_rate: peak learning rate after warm-up.
        min_lr: learning rate at the end of the cosine decay.
        warmup_steps: linear warm-up steps.
        lr_decay_steps: length of the schedule; default ``trainer.max_steps`` (never the Trainer's
            estimated stepping batches, which breaks streaming-loader resume:
            Lightning-AI/pytorch-lightning#20550).
        weight_decay: AdamW weight decay for matrices (not norms, biases or embeddings).
        betas: AdamW betas.
        cuda_graphs: replay the training step's forward and backward as CUDA graphs, so the
            host issues one launch where it issued hundreds: on the TE backend the transformer
            blocks (:mod:`fp8_lightning.graphs`), on the PyTorch backend the compiled model
            (``torch.compile(mode="reduce-overhead")``); captured at the first step. Default: on
            where that is measured to win: the TE backend on one GPU (the stack as one graph)
            and under DDP (a graph per block, DDP's all-reduce between them), or the PyTorch
            backend on one GPU with the torchao engine's float8 GEMMs (in BF16 they gained
            nothing measurable, so BF16 on the PyTorch backend stays without). FSDP2,
            FP8Stats, activation checkpointing and, on the PyTorch backend, gradient
            accumulation and DDP run without.
        compile: ``torch.compile`` the model for training (parameter names unchanged; see
            :func:`~fp8_lightning.model.compile_model`). Default: on a GPU where it works, one
            or several (DDP, FSDP2); off on a CPU (compilation costs more than a short CPU run
            saves). A compilation that fails at the first step falls back to eager with the
            reason.
        activation_checkpointing: trade compute for memory: ``none``; ``full`` (a checkpointed
            block keeps only its input and recomputes its forward in the backward: ~1/3 more
            compute, the least memory); ``mlp`` (selective: the MLP's norm, fc1 output and
            activation are recomputed, TE's ``LayerNormMLP(checkpoint=True)``: most of a block's
            activations for less recompute). Correct under FP8 (TE's checkpoint reuses the
            forward's scales). Turns CUDA graphs off.
        activation_checkpointing_every: checkpoint one block in every N (1: every block).
        memory_check: before the first step, estimate the GPU memory the run needs per GPU
            (:mod:`fp8_lightning.memory`: weights, gradients, AdamW state, activations), log it,
            and stop with the levers that would make it fit when it exceeds what the GPU has.
        init_from: start from these weights: a Hugging Face GPT-2 or Llama directory
            (config.json + safetensors, read offline) or a checkpoint of this package (its
            weights only; ``--ckpt_path`` resumes a run instead). The model shape comes from it:
            leave ``config`` unset, or set it to the same shape. Fine-tuning runs in FP8 as any
            run does.
    """

    def __init__(self, config: Optional[GPTConfig] = None,
                 backend: Literal["auto", "te", "torch"] = "auto",
                 attention: Literal["sdpa", "te"] = "sdpa", learning_rate: float = 6e-4,
                 min_lr: float = 6e-5, warmup_steps: int = 100,
                 lr_decay_steps: Optional[int] = None, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95),
                 compile: Optional[bool] = None, cuda_graphs: Optional[bool] = None,
                 activation_checkpointing: Literal["none", "full", "mlp"] = "none",
                 activation_checkpointing_every: int = 1, memory_check: bool = True,
                 init_from: Optional[str] = None) -> None:
        super().__init__()
        if isinstance(config, dict):  # from a checkpoint's hyperparameters
            config = GPTConfig.from_dict(config, "model.config (the checkpoint's hyperparameters)")
        if init_from is not None:
            from .hf import init_config

            config = init_config(init_from, config)
        elif config is None:
            config = GPTConfig()
        self.config = config
        problems = []
        if not learning_rate > 0:
            problems.append(f"model.learning_rate={learning_rate} must be > 0")
        if not 0 <= min_lr <= learning_rate:
            problems.append(f"model.min_lr={min_lr} must be between 0 and learning_rate")
        if warmup_steps < 0:
            problems.append(f"model.warmup_steps={warmup_steps} must be >= 0")
        if attention not in ("sdpa", "te"):
            problems.append(f"model.attention={attention!r}; valid: sdpa, te")
        if activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            problems.append(f"model.activation_checkpointing={activation_checkpointing!r}; valid: "
                            + ", ".join(ACTIVATION_CHECKPOINTING))
        if not 1 <= activation_checkpointing_every <= config.n_layer:
            problems.append(f"model.activation_checkpointing_every={activation_checkpointing_every}"
                            f"; valid: 1 (every block) to model.config.n_layer={config.n_layer}")
        if attention == "te" and backend == "torch":
            problems.append("model.attention='te' (te.DotProductAttention) needs model.backend "
                            "te or auto; with backend torch use attention sdpa")
        if problems:
            raise ConfigError(problems, "model")
        self.backend_name, self.backend_reason = resolve_backend(backend)
        if attention == "te" and self.backend_name != "te":  # auto fell back to PyTorch
            rank_zero_warn(f"model.attention='te' needs TransformerEngine ({self.backend_reason}); "
                           "using attention sdpa")
            attention = "sdpa"
        self.attention = attention
        # Plain types only: checkpoints stay loadable with torch.load(weights_only=True).
        self.save_hyperparameters(ignore=["config"])
        self.hparams["config"] = config.to_dict()
        self.model: Optional[GPT] = None
        # The fast path (fp8_lightning/fast_path.py), its compiled model and captured graphs.
        self._runner = FastPathRunner()
        self.tokens_seen = 0
        self.grad_norm: Optional[torch.Tensor] = None  # pre-clip total norm of the last step
        # Under FSDP2: would the run fit one GPU unsharded (the memory estimate; None: not
        # estimated)? FSDP2Strategy keeps the weights gathered from forward to backward then.
        self.fits_one_gpu: Optional[bool] = None
        # Under FSDP2: is there room for the step's CUDA graph (the memory estimate)?
        self.step_graph_fits = True
        self.val_loss = MeanMetric()
        self.val_step: Optional[int] = None  # global_step of the last validation (its weights)
        # The parameters and whether the clip folds into the optimizer, looked up at a run's
        # first step rather than every step: ``self.parameters()`` walks every submodule, twice
        # a step.
        self._params: Optional[tuple[torch.nn.Parameter, ...]] = None
        self._fold: Optional[bool] = None

    @property
    def fast_path(self) -> Optional[FastPath]:
        """What the training step compiles and replays, and why (:mod:`fp8_lightning.fast_path`):
        the compile part when the model is built, the CUDA graphs when training starts."""
        return self._runner.plan

    @fast_path.setter
    def fast_path(self, path: Optional[FastPath]) -> None:
        self._runner.plan = path

    @property
    def compiled(self) -> Optional[str]:
        """What ``compile_model`` compiled (the log's words), or None."""
        return self._runner.compiled

    @compiled.setter
    def compiled(self, what: Optional[str]) -> None:
        self._runner.compiled = what

    @override
    def configure_model(self) -> None:
        # Built here so that the Trainer's strategy decides device and sharding (TE allocates
        # on CUDA; FSDP can build on the meta device).
        if self.model is not None:
            return
        self._follow_fp8_engine()
        rank_zero_info(f"model: {self.config.name} on the {self.backend_name} backend "
                       f"({self.backend_reason}), attention={self.attention}")
        trainer = self._trainer
        self.fast_path = plan_compile(
            self.hparams.compile, "cuda" if torch.cuda.is_available() else "cpu",
            self.backend_name, sharded=trainer is not None and is_sharded(trainer.strategy))
        self._check_memory()
        hp = self.hparams
        self.model = GPT(self.config, backend=self.backend_name, attention=self.attention,
                         activation_checkpointing=hp.activation_checkpointing,
                         activation_checkpointing_every=hp.activation_checkpointing_every)
        if hp.activation_checkpointing != "none":
            blocks = checkpointed_blocks(self.config.n_layer, hp.activation_checkpointing_every)
            rank_zero_info(f"activation checkpointing: {hp.activation_checkpointing}, "
                           f"{len(blocks)} of {self.config.n_layer} blocks")
        if self.hparams.init_from is not None:
            from .hf import init_weights

            init_weights(self.model, self.hparams.init_from)
            rank_zero_info(f"model: weights from {self.hparams.init_from}")
        self._runner.apply_compile(self.model, hp.compile, self.backend_name)  # logged

    def memory_run(self, trainer: "L.Trainer", datamodule: Any) -> Optional["RunShape"]:
        """What besides the model decides this fit's memory per GPU (the micro-batch from the
        data module, sharding, FP8, residual, checkpointing, master dtype, compile,
        accumulation); None when the micro-batch is not known before the first batch."""
        hp = self.hparams
        return run_shape(trainer, datamodule, self.config, self.backend_name,
                         activation_checkpointing=hp.activation_checkpointing,
                         activation_checkpointing_every=hp.activation_checkpointing_every,
                         compiled_loss=self.fast_path is not None and self.fast_path.compile)

    def _check_memory(self) -> None:
        """Before the model is built on a GPU of a fit: log the memory estimate per GPU, and
        stop with the levers that would make it fit when it cannot (``model.memory_check``;
        :mod:`fp8_lightning.memory_check`)."""
        self.fits_one_gpu, self.step_graph_fits = None, True  # this fit's answers, or none
        trainer = self._trainer
        if not is_gpu_fit(trainer):
            return
        run = self.memory_run(trainer, getattr(trainer, "datamodule", None))
        if run is None:
            return
        check = check_memory(trainer, self.config, run, backend=self.backend_name,
                             step_graph=self.hparams.cuda_graphs is not False)
        self.fits_one_gpu, self.step_graph_fits = check.fits_one_gpu, check.step_graph_fits
        check.enforce(self.hparams.memory_check)

    def _follow_fp8_engine(self) -> None:
        """``model.backend: auto`` builds the layers the FP8 plugin's engine converts (TE's, or the
        PyTorch ones for torchao); with ``engine: auto`` the plugin measures first."""
        plugin = fp8_plugin(self._trainer) if self._trainer is not None else None
        if plugin is None:
            return
        datamodule = getattr(self._trainer, "datamodule", None)
        if getattr(datamodule, "batch_size", None) and getattr(datamodule, "seq_len", None):
            plugin.tokens_per_micro_batch = datamodule.batch_size * datamodule.seq_len
        if self.hparams.backend != "auto":
            return
        if plugin.auto:
            from .engine_auto import choose_engine

            several = self._trainer.world_size > 1
            choose_engine(plugin, type(self), self.config, getattr(datamodule, "batch_size", 8),
                          getattr(datamodule, "seq_len", self.config.block_size), self.attention,
                          self._trainer.strategy.broadcast if several else None)
        backend = plugin.backend
        if backend != self.backend_name and (backend == "torch" or te_status()[0]):
            self.backend_name = backend
            self.backend_reason = ("engine auto measured BF16 fastest" if plugin.auto_bf16 else
                                   f"the layers FP8 engine {plugin.engine.name} converts")
            if self.attention == "te" and backend == "torch":
                rank_zero_warn("model.attention='te' needs the TE backend; SDPA with the "
                               f"{plugin.engine.name} engine")
                self.attention = "sdpa"

    def plan_graphs(self) -> FastPath:
        """Decide the CUDA graphs of this run's training step (after the FP8 plugin converted
        the model), compile the model for them (lazily: the first call compiles), log it; the
        training step captures them at its first call, which has the micro-batch's shape."""
        return self._runner.plan_graphs(
            self.model, self._trainer, wanted=self.hparams.cuda_graphs,
            compile_wanted=self.hparams.compile, backend=self.backend_name,
            device_type=self.device.type,
            activation_checkpointing=self.hparams.activation_checkpointing,
            step_graph_fits=self.step_graph_fits)

    @property
    def graphed(self) -> Optional[str]:
        """What the training step's CUDA graphs replay now (after a fit: replayed at its end,
        FSDP2's step graph being freed then), ``"FP8"`` or ``"BF16"``; None while no graph
        replays (not captured, off, or on the TE backend stepped aside for a BF16 fallback; the
        PyTorch backend's graphs replay either, each captured once)."""
        return self._runner.graphed(self.model)

    def loss(self, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Mean next-token cross-entropy of a batch of token blocks (B, T + 1), and the tokens
        it covers: the training step of ``fit`` and of ``bench``."""
        batch = batch.long()
        x, y = batch[:, :-1], batch[:, 1:]  # (B, T) inputs and next-token targets
        loss = self._runner.loss(self.model, x, y, training=self.training, trainer=self._trainer)
        return loss, y.numel()

    def tokenizer_problem(self, used: Optional[str]) -> Optional[str]:
        """With ``model.init_from``: the data's tokenizer ``used`` must be the one the weights were
        trained with; the problem, or None (no init_from, or either side unknown)."""
        if self.hparams.init_from is None or not used:
            return None
        from .hf import init_source
        from .tokenizer import same_tokenizer

        wanted = init_source(self.hparams.init_from)[1]
        if wanted and not same_tokenizer(wanted, used):
            return (f"data.tokenizer={used!r} but the weights of model.init_from were trained "
                    f"with {wanted!r}; set --data.tokenizer {wanted}")
        return None

    @override
    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        meta = getattr(datamodule, "meta", None) or {}
        problems = []
        # (With init_from the vocabulary is the weights': a mismatch is the tokenizer's, below.)
        if meta.get("vocab_size", 0) > self.config.vocab_size and self.hparams.init_from is None:
            problems.append(f"model.config.vocab_size={self.config.vocab_size} is smaller than the "
                            f"dataset's tokenizer ({meta.get('tokenizer')}: {meta['vocab_size']}); "
                            f"set model.config.vocab_size={meta['vocab_size']}")
        if datamodule is not None:
            problem = self.tokenizer_problem(meta.get("tokenizer") or
                                             getattr(datamodule, "tokenizer", None))
            problems += [problem] if problem else []
        seq_len = getattr(datamodule, "seq_len", None)
        if seq_len is not None and seq_len > self.config.block_size:
            problems.append(f"data.seq_len={seq_len} exceeds model.config.block_size="
                            f"{self.config.block_size}")
        if problems:
            raise ConfigError(problems, "model/data")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def step_with_backward(self, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The fast path ``"step"`` (under FSDP2): forward and backward of a micro-batch in one
        CUDA graph (:mod:`fp8_lightning.step_graph`), the forward in the precision plugin's
        autocast; :meth:`backward` then has nothing left to do. The loss, and the tokens."""
        trainer = self.trainer
        batch = batch.long()
        x, y = batch[:, :-1], batch[:, 1:]  # (B, T) inputs and next-token targets
        loss = self._runner.step_with_backward(self.model, x, y, trainer, training=self.training)
        return loss, y.numel()

    @override
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self._runner.backward_done:  # step_with_backward's: the graph held it
            self._runner.backward_done = False
            return
        super().backward(loss, *args, **kwargs)

    @override
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        step_graph = self.fast_path is not None and self.fast_path.graphs == "step"
        self._runner.backward_done = False  # (a backward Lightning skipped leaves none pending)
        loss, tokens = self.step_with_backward(batch) if step_graph else self.loss(batch)
        self.tokens_seen += tokens * self.trainer.world_size
        # Logged on the steps Lightning writes to the loggers (every log_every_n_steps) and on
        # a run's or an epoch's last step, not on the others, whose value the loggers discard:
        # each self.log costs host time a host-bound step cannot spare. So
        # ``callback_metrics["train/loss"]`` is at most log_every_n_steps - 1 steps old. Not on
        # the progress bar: the bar reads it every step, a host sync (TrainingMonitor prints the
        # loss instead). The condition is the one Lightning writes to the loggers by (its private
        # _LoggerConnector.should_update_logs), plus the last steps, so that callback_metrics
        # ends on the run's final loss.
        trainer = self.trainer
        step = trainer.global_step + 1  # the step this batch completes
        if (step % max(1, trainer.log_every_n_steps) == 0 or step == trainer.max_steps
                or trainer.is_last_batch or trainer.should_stop):
            self.log("train/loss", loss)
        return loss

    def trained_parameters(self) -> tuple[torch.nn.Parameter, ...]:
        """``self.parameters()``, kept from the first training step of a run (after the
        strategy's setup, so FSDP2's DTensors); ``on_train_start`` forgets it, for a module
        fitted again with other parameters."""
        if self._params is None:
            self._params = tuple(self.parameters())
        return self._params

    @override
    def on_after_backward(self) -> None:
        # Total gradient norm before clipping, left on the device (no host sync): the NaN guard
        # and the monitor read it in on_before_optimizer_step. Under FSDP the gradients are
        # DTensor shards and the norm is all-reduced (a collective on the device, no host wait).
        # (Callbacks' on_after_backward hooks run before this one, so an injected fault is seen.)
        grads = [p.grad for p in self.trained_parameters() if p.grad is not None]
        if grads:
            self.grad_norm = full_tensor(torch.nn.utils.get_total_norm(grads)).float()

    @override
    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer,
                                    gradient_clip_val: Optional[float] = None,
                                    gradient_clip_algorithm: Optional[str] = None) -> None:
        # Clip with the norm on_after_backward already computed: no second pass, no host sync.
        # (Lightning's own path refuses fused optimizers under bf16-mixed, and the fused AdamW is
        # what lets the NaN guard skip a step on the device.)
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
        if self._fold is None:  # one optimizer per run (configure_optimizers)
            self._fold = takes_grad_scale(optimizer, self.trained_parameters())
        fold = self._fold
        if fold:
            optimizer.grad_scale = None  # no clip this step unless set below
        if not gradient_clip_val:
            return
        if gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(self.parameters(), gradient_clip_val)
        elif self.grad_norm is not None and fold:
            # The clip as the fused AdamW's ``grad_scale`` (the divisor GradScaler uses): the
            # update divides each gradient by it in its own pass and writes the clipped gradient
            # back, instead of a separate pass over every gradient. Same coefficient as
            # clip_grads_with_norm_: max_norm / (norm + 1e-6).
            optimizer.grad_scale = (self.grad_norm + 1e-6).div(gradient_clip_val).clamp(min=1.0)
        elif self.grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(self.trained_parameters(), gradient_clip_val,
                                                 self.grad_norm)

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any,
                       optimizer_closure: Optional[Callable[[], Any]] = None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # Lightning zeroes gradients inside the next step's closure, after its forward: the last
        # step's gradients would sit beside that forward's activations (a large model under FSDP2
        # runs out of memory so). Dropped here, as a plain PyTorch loop (and bench's step) does;
        # zeroed in place under a whole-step graph, whose reduce-scatters add into them.
        optimizer.zero_grad(set_to_none=self._runner.step_graph is None)

    @override
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        """Nothing to do: optimizer_step has dropped the gradients (a second pass over every
        parameter per step saved on the host)."""

    @override
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss, tokens = self.loss(batch)
        self.val_loss.update(loss, weight=tokens)

    @override
    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        # MeanMetric.compute() has already reduced over every rank: the value is the same on all,
        # so sync_dist's mean leaves it unchanged (and keeps Lightning from warning).
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", torch.exp(loss), sync_dist=True)
        if not self.trainer.sanity_checking:
            self.val_step = self.trainer.global_step

    @override
    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    @override
    def on_test_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("test/loss", loss)
        self.log("test/ppl", torch.exp(loss))

    @override
    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch.long()[:, :-1]).argmax(dim=-1)

    def decay_steps(self) -> int:
        steps = self.hparams.lr_decay_steps or self.trainer.max_steps
        if steps is None or steps <= 0:
            raise ConfigError(["trainer.max_steps is not set: the learning-rate schedule needs "
                               "trainer.max_steps (or model.lr_decay_steps)"], "trainer")
        return steps

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        embeddings = {id(self.model.wte.weight)}
        if hasattr(self.model, "wpe"):
            embeddings.add(id(self.model.wpe.weight))
        decay, no_decay = [], []
        for p in self.model.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 and id(p) not in embeddings else no_decay).append(p)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.learning_rate, betas=tuple(hp.betas),
            fused=True)  # fused (CUDA and CPU) takes the NaN guard's found_inf: skips on device
        decay_steps = self.decay_steps()
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_at(step, max_lr=hp.learning_rate, min_lr=hp.min_lr,
                                          warmup_steps=hp.warmup_steps,
                                          decay_steps=decay_steps) / hp.learning_rate)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def precision_tag(self) -> str:
        """``FP8 delayed`` or ``BF16 (fallback: reason)`` under FP8Precision, else the Trainer's."""
        plugin = fp8_plugin(self.trainer)
        return plugin.status if plugin is not None else str(self.trainer.precision)

    def effective_precision(self) -> str:
        """``fp8-<recipe>`` or ``bf16`` under FP8Precision, else the Trainer's precision."""
        plugin = fp8_plugin(self.trainer)
        return plugin.effective_precision if plugin is not None else str(self.trainer.precision)

    @override
    def on_train_start(self) -> None:
        self._params, self._fold = None, None
        AgreedStop.install(self.trainer)  # several ranks: no host sync per step for SIGTERM
        self._runner.drop_graphs()
        self.plan_graphs()  # the plugin has converted the model: the graphs can be decided
        rank_zero_info(f"precision: {self.precision_tag()}")
        datamodule = getattr(self.trainer, "datamodule", None)
        if hasattr(datamodule, "verify_resumed"):
            datamodule.verify_resumed()

    @override
    def teardown(self, stage: str) -> None:
        if self._trainer is not None:
            AgreedStop.uninstall(self._trainer)
        if self._runner.step_graph is not None:  # (``graphed`` still says what it replayed)
            self._runner.step_graph.free()

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The last validation's loss and the step it measured: a checkpoint written after more
        # training steps (last.ckpt) records an older val_loss, and says so (`checkpoints`).
        val_loss = self.trainer.callback_metrics.get("val/loss")
        checkpoint["tokens_seen"] = self.tokens_seen
        checkpoint["fp8_lightning"] = {
            "backend": self.backend_name, "config": self.config.to_dict(),
            "precision": self.effective_precision(), "versions": checkpoint_versions(),
            "val_loss": None if val_loss is None else float(val_loss),
            "val_step": None if val_loss is None else self.val_step, "rng": rng_state(),
            "tokenizer": self._tokenizer()}

    def _tokenizer(self) -> Optional[str]:
        """The tokenizer the training data was prepared with (``gpt2`` or a tokenizer.json path):
        what ``generate`` must decode with. The dataset's meta.json says; else the data module."""
        datamodule = getattr(self.trainer, "datamodule", None)
        meta = getattr(datamodule, "meta", None) or {}
        return meta.get("tokenizer") or getattr(datamodule, "tokenizer", None)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        meta = checkpoint.get("fp8_lightning")
        if meta is None:
            raise CheckpointError("the checkpoint was not written by fp8-lightning (no "
                                  "'fp8_lightning' entry); load its weights yourself or start "
                                  "without --ckpt_path")
        check_same_model(meta.get("config", {}), self.config)
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))
        if meta.get("rng"):
            set_rng_state(meta["rng"])

