"""`LSHSoftmax`: a wide softmax layer that, in training, computes only an active set of classes.

    head = LSHSoftmax(128, 200_000, bits=9, tables=16)       # or config=LSHConfig(...)
    optimizer = LazyAdam(model.parameters(), lr=1e-3)
    loss = head(h, labels)           # training: h (B, 128), labels (B, M) padded with -1
    loss.backward(); optimizer.step()
    head.eval(); logits = head(h)    # (B, C): exact, or head(h, inference="lsh")

One training step (SLIDE, with Mongoose's batch-level engine):
1. hash h's rows into the L tables; the batch's active set is its labels, every class
   the tables return for any of its rows (in at least min_hits of the row's tables; at
   most max_active of them, the most often returned), and random classes
   up to min_active (active.py's `active_set`);
2. logits (B, A) = h @ W[active].T + b[active], one dense matmul; log-softmax over the
   active set; loss = mean over rows of -sum over its labels of log p / |labels| (SLIDE's
   soft multi-label target);
3. backward gives W and b sparse gradients: only the A active rows (LazyAdam steps them);
4. every `redraw_every` steps (if set) new hash functions are drawn and every class is
   rehashed (SLIDE's rebuild); every `check_every` steps a probe rehashes up to
   probe_rows random classes among those active since the last build (only they can
   have moved: a class's row changes only when it is active); once the share of their
   codes that changed reaches rebuild_threshold, every class is rehashed. (A probe of
   random classes of all C saw mostly untouched rows, so it rebuilt late while the
   retrieved rows, the ones trained each step, went stale.)

In a myelin pipeline the labels reach the last stage through the loss function, not the
module: with `loss_fn=head.loss`, a training forward without labels returns h unchanged
and `head.loss(h, labels)` does step 2; in eval mode forward returns logits and
`head.loss(logits, labels)` is the exact soft-target cross-entropy.

Memory per class (fp32, H = in_features, L = tables): weights and bias 4 (H + 1) bytes;
LazyAdam 8 (H + 1) + 16 bytes (moments, per-row step counts of W and b); tables 20 L
bytes (codes, sorted keys, ids); 1 byte marking the classes active since the last build;
9 bytes of per-step scratch (the class -> active position map and the active mask). At
H = 128, L = 8: 516 + 1048 + 160 + 10, about 1.7 KB. In a one-rank Trainer, retry's
`savepoint()` holds 1 byte more a class during a step (the marks), and a copy of the
tables and hash functions during a step that rebuilds them, so a failed step is undone.
Per step: A (H + 1) floats of gathered rows and B A of logits, A the active set's size.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from myelin.errors import ConfigError
from myelin.nn.config import INFERENCE, LSHConfig
from myelin.nn.hashing import Hasher, stream_seed
from myelin.nn.tables import LSHTables, SeededModule, active_set
from myelin.nn.targets import as_label_matrix, soft_target, soft_target_loss, sparse_rows

__all__ = ["LSHSavepoint", "LSHSoftmax", "soft_target_loss", "sparse_rows"]  # (targets.py)


class LSHSoftmax(SeededModule):
    """Linear layer to `num_classes` logits trained on an LSH-chosen active set."""

    sparse_gradients = ("weight", "bias")  # only the active rows: memory budgets count those

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        config: LSHConfig | None = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        if config is not None and settings:
            raise ConfigError(f"give config= or settings ({', '.join(settings)}), not both")
        if config is None:
            try:
                config = LSHConfig(**settings)
            except TypeError as exc:
                raise ConfigError(f"LSHSoftmax: {exc} (see myelin.nn.LSHConfig)") from None
        if not isinstance(config, LSHConfig):
            raise ConfigError(f"config={config!r} must be a myelin.nn.LSHConfig")
        config.check_layer(in_features, num_classes)
        self.config, self.in_features, self.num_classes = config, in_features, num_classes
        self.weight = nn.Parameter(torch.empty(num_classes, in_features))
        self.bias = nn.Parameter(torch.empty(num_classes))
        self.hasher = Hasher(
            config.family, in_features, config.bits, config.tables, config.bin_size, config.seed
        )
        self.tables = LSHTables(self.hasher, num_classes, config.bucket_cap, config.seed)
        self._seed(stream_seed(config.seed, "floor"))  # the floor's and probes' generator
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("draws", torch.zeros((), dtype=torch.long))  # hash redraws so far
        # classes active in training since the last build: the only rows that can have moved
        self.register_buffer("moved", torch.zeros(num_classes, dtype=torch.bool))
        self.active = torch.zeros(0, dtype=torch.long)
        # what happened in this process (not saved): rebuilds after the first build, probes,
        # last probe's change, the last active set's size and its labels, retrieved (not
        # labels) and floor classes
        self.stats = {"rebuilds": 0, "redraws": 0, "checks": 0, "last_change": 0.0}
        self.stats.update(last_active=0, last_labels=0, last_retrieved=0, last_floor=0)
        self._savepoint: weakref.ref[LSHSavepoint] | None = None  # the latest, while alive
        # built on the meta device (myelin.init_empty): shapes only until reset_parameters
        self._unbuilt = self.weight.is_meta
        if not self._unbuilt:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw the weights, hash functions and tables of `config.seed` as a new layer does:
        torch's hook, which myelin calls on a layer built under `init_empty` once allocated."""
        if self.weight.is_meta:  # nothing to draw into yet
            return
        g = torch.Generator().manual_seed(stream_seed(self.config.seed, "weight"))
        bound = 1 / math.sqrt(self.in_features)
        # drawn on the CPU, so every device and dtype starts from the same numbers
        self.weight.copy_(torch.empty(self.weight.shape).uniform_(-bound, bound, generator=g))
        self.bias.zero_()
        self.hasher.reset()
        self.tables.reset()
        self._reseed(stream_seed(self.config.seed, "floor"))
        self.steps.zero_()
        self.draws.zero_()
        self.active = torch.zeros(0, dtype=torch.long)
        self._unbuilt = False
        self._build()

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any, **kw: Any) -> None:
        # checkpoints from before hash redraws: no redraw yet (as BatchNorm's counter)
        state_dict.setdefault(prefix + "draws", torch.zeros((), dtype=torch.long))
        super()._load_from_state_dict(state_dict, prefix, *args, **kw)
        if prefix + "tables.keys" in state_dict:  # the checkpoint's tables and hash functions
            self._unbuilt = False
            self._probed = self.weight._version
        elif prefix + "weight" in state_dict and not self.weight.is_meta:
            self._build()  # weights alone (a dense layer's): tables of the loaded ones

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"in_features={self.in_features}, num_classes={self.num_classes}, "
            f"family={c.family!r}, bits={c.bits}, tables={c.tables}"
        )

    @torch.no_grad()
    def rebuild(self) -> None:
        """Rehash every class into the tables (after the weights were changed by hand)."""
        self._build()
        self.stats["rebuilds"] += 1

    @torch.no_grad()
    def _build(self) -> None:
        """Hash every class into the tables; no class has moved since."""
        self._keep_tables()
        self.tables.build(self.weight)
        self.moved.zero_()
        self._probed = self.weight._version  # the weights' in-place count the tables know

    def _check_built(self) -> None:
        """A layer built under init_empty has no tables until reset_parameters draws them."""
        if getattr(self, "_unbuilt", False):  # absent from modules pickled before it
            raise ConfigError(
                "LSHSoftmax was built on the meta device (myelin.init_empty) and never "
                "initialised: call its reset_parameters() once allocated, or load a checkpoint"
            )

    # -- training ------------------------------------------------------------------

    def forward(
        self, h: torch.Tensor, labels: torch.Tensor | None = None, *, inference: str | None = None
    ) -> torch.Tensor:
        """Training with labels: the active-set loss. Training without labels: h itself,
        for `loss_fn=self.loss`. Eval: logits (B, num_classes), exact or LSH-only (no
        gradient: inference), or with labels the exact loss, as training's call gives one."""
        if not self.training:
            if labels is not None:
                return self.loss(self.logits(h, "exact"), labels)
            return self.logits(h, inference)
        if labels is None:
            return h
        return self.loss(h, labels)

    def loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Training: the active-set softmax loss of hidden `output` (B, in_features).
        Eval: the exact soft-target cross-entropy of logits `output` (B, num_classes)."""
        self._check_built()
        self._check_output(output)
        labels = as_label_matrix(labels, output.shape[0], self.num_classes)
        if not self.training:
            made = getattr(self, "_lsh_of", None)
            if made is not None and made[0]() is output:  # forward's LSH-only logits
                with torch.no_grad():
                    output = self.logits(made[1], "exact")  # the loss is the exact one
            return self._eval_loss(output, labels)
        self._maybe_rebuild()
        c = self.config
        retrieved, _ = self._retrieve(output.detach())
        counts: dict[str, int] = {}
        active = active_set(
            self.num_classes, labels, retrieved, c.min_active, c.max_active, self._gen, counts
        )
        self.stats["last_active"] = active.numel()
        self.stats.update({f"last_{k}": v for k, v in counts.items()})
        self.moved[active] = True
        self.active = active  # the last training batch's active classes, for inspection
        where = torch.full((self.num_classes,), -1, dtype=torch.long, device=active.device)
        where[active] = torch.arange(active.numel(), device=active.device)
        w, b = sparse_rows(active, self.weight, self.bias)
        logits = torch.addmm(b, output.to(w.dtype), w.t())  # (B, A), in the layer's dtype
        pos = torch.where(labels >= 0, where[labels.clamp(min=0)], labels)
        return soft_target(logits, pos)

    def _eval_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The exact soft-target loss of eval logits; LSH-only ones (a label's class not
        retrieved is at -inf, the loss infinite) are refused, saying what to do instead."""
        at = logits.gather(1, labels.clamp(min=0))
        if bool((torch.isneginf(at) & (labels >= 0)).any()):
            raise ConfigError(
                "LSHSoftmax.loss in eval takes exact logits, but these are LSH-only "
                "(inference='lsh'): a label the tables did not retrieve has logit -inf and "
                "the loss would be infinite. Evaluate with inference='exact' (the default) "
                "and ask for LSH predictions with head.predict(h, k, inference='lsh')"
            )
        return soft_target(logits, labels)

    def _check_output(self, output: torch.Tensor) -> None:
        """`loss` takes what forward returns: h (B, in_features) in training, logits in eval."""
        if self.training:
            want, what = self.in_features, "the hidden activations forward returns in training"
        else:
            want, what = self.num_classes, "the logits forward returns in eval mode"
        if not isinstance(output, torch.Tensor) or output.dim() != 2 or output.shape[1] != want:
            got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
            raise ConfigError(f"loss: output {got} must be (B, {want}), {what}")

    def _retrieve(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (class, row) pairs the tables return for `h`, each held by at least
        `min_hits` of that row's tables: in training and in LSH inference alike."""
        ids, row = self.tables.query(self.hasher(h))
        if self.config.min_hits > 1:
            pair, hits = torch.unique(row * self.num_classes + ids, return_counts=True)
            pair = pair[hits >= self.config.min_hits]
            ids, row = pair % self.num_classes, pair // self.num_classes
        return ids, row

    def _maybe_rebuild(self) -> None:
        """Count a training step; every check_every steps probe how far the classes active
        since the last build moved, and rehash everything when it passed the threshold."""
        self.steps += 1
        c = self.config
        step = int(self.steps)
        if c.redraw_every is not None and step % c.redraw_every == 0:
            self.draws += 1
            self._keep_tables()
            self.hasher.redraw(int(self.draws))
            self.stats["redraws"] += 1
            self.rebuild()
            return
        if step % c.check_every == 0:
            self._probe(self._gen)

    def _probe(self, gen: torch.Generator) -> None:
        """Rehash up to probe_rows of the classes marked moved; rebuild past the threshold."""
        moved = self.moved.nonzero().squeeze(1)
        change = 0.0
        if moved.numel():
            pick = torch.randperm(moved.numel(), generator=gen)[: self.config.probe_rows]
            change = self.tables.changed_fraction(self.weight, moved[pick.to(moved.device)])
        self.stats["checks"] += 1
        self.stats["last_change"] = change
        self._probed = self.weight._version
        if change >= self.config.rebuild_threshold:
            self.rebuild()

    # -- a failed step, forgotten -----------------------------------------------------

    def savepoint(self) -> LSHSavepoint:
        """What a training step changes in the layer besides its weights, so that
        `restore` can put it back when the step fails before its update (myelin.retry):
        the step counter, hash redraws, the classes marked moved, both random generators,
        `stats` and `active`. Cheap: a copy of `moved` (one byte a class) and two
        generator states; the tables and hash functions are copied only if the step
        rebuilds or redraws them, and only while the savepoint is alive."""
        saved = LSHSavepoint(self)
        self._savepoint = weakref.ref(saved)
        return saved

    @torch.no_grad()
    def restore(self, saved: LSHSavepoint) -> None:
        """The layer's state as at `saved` (taken by this layer's `savepoint`); the weights
        are not touched (a step that failed before its update did not change them)."""
        if saved.layer is not self:
            raise ConfigError("restore: the savepoint was taken of another LSHSoftmax layer")
        if saved.tables is not None:  # the step rebuilt or redrew: the tables as they were
            for live, value in saved.tables:
                live.copy_(value)
        self.steps.copy_(saved.steps)
        self.draws.copy_(saved.draws)
        self.moved.copy_(saved.moved)
        self._gen.set_state(saved.gen)
        self.tables._gen.set_state(saved.table_gen)
        self.stats = dict(saved.stats)
        self.active = saved.active

    def __getstate__(self) -> dict[str, Any]:
        """As nn.Module's, less the weak references (they do not pickle)."""
        return {**self.__dict__, "_savepoint": None, "_lsh_of": None}

    def _keep_tables(self) -> None:
        """Before a rebuild or redraw overwrites them: a copy of the tables and hash
        functions for the live savepoint, if there is one and it has none yet."""
        saved = self._savepoint() if self._savepoint is not None else None
        if saved is not None and saved.tables is None:
            saved.tables = [
                (b, b.clone()) for m in (self.tables, self.hasher) for b in m.buffers(recurse=False)
            ]

    # -- inference -----------------------------------------------------------------

    def logits(self, h: torch.Tensor, inference: str | None = None) -> torch.Tensor:
        """(B, num_classes) logits: all of them ("exact", with a gradient as nn.Linear's
        would have: fine-tuning in eval mode works), or only each row's retrieved classes
        with -inf elsewhere ("lsh", no gradient: retrieval is not differentiable)."""
        self._check_built()
        mode = self.config.inference if inference is None else inference
        if mode not in INFERENCE:
            raise ConfigError(f"inference={mode!r} must be one of {INFERENCE}")
        if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[1] != self.in_features:
            got = tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
            raise ConfigError(
                f"LSHSoftmax: input {got} must be (B, {self.in_features}): in_features="
                f"{self.in_features}, the width of the hidden activations it was built for"
            )
        x = h.to(self.weight.dtype)  # as training: retrieval hashes h, the matmul takes x
        if mode == "exact":
            if torch.is_grad_enabled() and self.weight.requires_grad:
                self.moved.fill_(True)  # every row may move (fine-tuning in eval mode)
            return F.linear(x, self.weight, self.bias)
        if self.weight._version != getattr(self, "_probed", self.weight._version):
            # the weights moved since the tables were last checked: probe them first, on a
            # generator of its own (training's random stream is left as it was)
            self._probe(torch.Generator().manual_seed(self.weight._version))
        out = self._lsh_logits(h, x)
        self._lsh_of = (weakref.ref(out), h.detach())  # for an exact eval loss of `out`
        return out

    @torch.no_grad()
    def _lsh_logits(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ids, row = self._retrieve(h)
        active = torch.unique(ids)
        where = torch.full((self.num_classes,), -1, dtype=torch.long, device=h.device)
        where[active] = torch.arange(active.numel(), device=h.device)
        part = torch.addmm(self.bias[active], x, self.weight[active].t())  # (B, A)
        mine = torch.zeros_like(part, dtype=torch.bool)
        mine[row, where[ids]] = True
        out = torch.full((h.shape[0], self.num_classes), -math.inf, device=h.device,
                         dtype=part.dtype)  # fmt: skip
        out[:, active] = part.masked_fill(~mine, -math.inf)
        return out

    @torch.no_grad()
    def predict(self, h: torch.Tensor, k: int = 1, inference: str | None = None) -> torch.Tensor:
        """(B, k) the top-k classes of each row (a row with fewer LSH candidates than k
        gets arbitrary ids for the rest, with -inf logits)."""
        if type(k) is not int or not 1 <= k <= self.num_classes:
            raise ConfigError(f"predict: k={k!r} must be an int in [1, {self.num_classes}]")
        return torch.topk(self.logits(h, inference), k, dim=1).indices


class LSHSavepoint:
    """An `LSHSoftmax`'s state before a step (see `LSHSoftmax.savepoint`)."""

    def __init__(self, layer: LSHSoftmax) -> None:
        self.layer = layer
        self.steps, self.draws = layer.steps.clone(), layer.draws.clone()
        self.moved = layer.moved.clone()
        self.gen, self.table_gen = layer._gen.get_state(), layer.tables._gen.get_state()
        self.stats, self.active = dict(layer.stats), layer.active
        # (buffer, its value) of the tables and hash functions: copied on the first rebuild
        self.tables: list[tuple[torch.Tensor, torch.Tensor]] | None = None
