"""The policy loss, composed once from ``GRPOConfig``: a surrogate (``grpo.loss.policy_loss``:
:class:`OffPolicyClip`, REC and GSPO (:class:`PiOldTerm`), or a user's class named
``path/to/file.py:Name`` / ``package.module:Name``), times the ``grpo.off_policy.tis`` weight,
plus the ``grpo.loss.regularizer`` term (:func:`build_policy_loss`).

Every part is a :class:`LossTerm`: it declares the log-probs it reads by role (``needs``) and
receives them by name in a :class:`RoleLogprobs`, so the trainer scores exactly the passes
the loss declares (trainer/logprobs.py) and a new loss is one class in one module
(docs/algorithms.md, "Write your own loss"). The per-token math is algorithms/losses.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from typing import ClassVar, Protocol, runtime_checkable

from torch import Tensor

from megatron_grpo.algorithms.losses import (
    asymre_term,
    gspo_loss,
    mask_weight,
    mismatch_tis_weight,
    off_policy_clip_loss,
    opmd_term,
    rec_loss,
    rec_mask_none,
    rec_mask_one_side,
    rec_mask_ring,
    rec_mask_two_side,
    rec_weight_is,
    rec_weight_none,
    rec_weight_tis,
    seq_is_ratio,
    token_is_ratio,
    truncate_weight,
)
from megatron_grpo.algorithms.step_batch import Metrics
from megatron_grpo.config.plugins import load_object
from megatron_grpo.config.schema import ConfigError, GRPOConfig


class Role(StrEnum):
    """Which policy a log-prob tensor is of, in the paper's terms (docs/algorithms.md,
    "Which log-probs play which role"); the differentiable policy pi is the loss's own
    ``logp_BT``."""

    ALPHA_ENGINE = "alpha_engine"
    """alpha, the behaviour policy, as the engine served it (its log-probs come with the
    samples: always there)."""
    ALPHA_TRAINER = "alpha_trainer"
    """alpha's weights scored on the trainer's numerics (``grpo.off_policy.score_alpha``)."""
    PI_K = "pi_k"
    """the trainer's weights before the step's first update."""
    PI_REF = "pi_ref"
    """the KL reference."""


@dataclass(frozen=True, kw_only=True)
class RoleLogprobs:
    """The log-probs a loss reads, by role: ``[B, T]``, position-aligned with ``logp_BT``;
    None where the step did not score that role (no loss term declared it)."""

    alpha_engine: Tensor
    alpha_trainer: Tensor | None = None
    pi_k: Tensor | None = None
    pi_ref: Tensor | None = None

    def of(self, role: Role) -> Tensor:
        """The log-probs of ``role``; a one-line error when the step did not score them."""
        t: Tensor | None = getattr(self, role.value)
        if t is None:
            raise ValueError(
                f"the loss reads {role.value}'s log-probs, which the step did not score: "
                f"add Role.{role.name} to the loss term's `needs` (the trainer scores what "
                "its loss declares)."
            )
        return t


@runtime_checkable
class LossTerm(Protocol):
    """A per-token term of the policy loss: ``term(logp_BT, adv=, mask_BT=, lp=) ->
    (loss_BT, metrics)``, unaggregated (algorithms/aggregation.py aggregates), with
    ``needs``, the roles of ``lp`` it reads. ``adv`` is ``[B]`` or ``[B, T]``; ``mask_BT``
    is 1 on the loss tokens; metrics are detached 0-dim tensors over ``mask_BT``."""

    @property
    def needs(self) -> frozenset[Role]: ...

    def __call__(
        self, logp_BT: Tensor, *, adv: Tensor, mask_BT: Tensor, lp: RoleLogprobs
    ) -> tuple[Tensor, Metrics]: ...


def _alpha_role(c: GRPOConfig) -> Role:
    """Whose alpha the surrogate's ratios are taken against: the trainer's scoring of it
    under ``grpo.off_policy.score_alpha`` (the staleness ratio, algorithms/staleness.py), else the
    engine's."""
    return Role.ALPHA_TRAINER if c.off_policy.score_alpha else Role.ALPHA_ENGINE


def _pi_old(c: GRPOConfig) -> Role:
    """pi_old of the ratio rho = pi / pi_old (REC, GSPO, OPMD): pi_k under
    ``ratio_mode=exact``, else alpha."""
    return Role.PI_K if c.off_policy.ratio_mode == "exact" else _alpha_role(c)


# ------------------------------------------------------------------------------- surrogates
@dataclass(frozen=True)
class OffPolicyClip:
    """``-f_eps(r, r', A)`` (off-policy GRPO eq. 6-7): ``r = pi/alpha``, ``r' = pi_k/alpha``
    under ``ratio_mode=exact`` else 1; with ``around_pi_k`` (``grpo.off_policy.tis`` without
    ``score_alpha``) PPO around pi_k, ``r = pi/pi_k``, ``r' = 1``, which the TIS weight
    ``min(pi_k/alpha, C)`` multiplies: the truncated form of the exact objective."""

    eps_low: float
    eps_high: float
    dual_clip_c: float | None
    alpha: Role
    exact: bool
    around_pi_k: bool

    @classmethod
    def from_config(cls, c: GRPOConfig) -> OffPolicyClip:
        around = c.off_policy.tis != "none" and not c.off_policy.score_alpha
        return cls(c.loss.clip_eps_low, c.loss.clip_eps_high, c.loss.dual_clip_c, _alpha_role(c),
                   c.off_policy.ratio_mode == "exact", around)  # fmt: skip

    @property
    def needs(self) -> frozenset[Role]:
        if self.around_pi_k:
            return frozenset({Role.PI_K})
        return frozenset({self.alpha, *([Role.PI_K] if self.exact else [])})

    def __call__(
        self, logp_BT: Tensor, *, adv: Tensor, mask_BT: Tensor, lp: RoleLogprobs
    ) -> tuple[Tensor, Metrics]:
        lo, hi, dual = self.eps_low, self.eps_high, self.dual_clip_c
        if self.around_pi_k:
            base = lp.of(Role.PI_K)
            return off_policy_clip_loss(logp_BT, base, adv, mask_BT, lo, hi, dual_clip_c=dual)
        pi_k = lp.of(Role.PI_K) if self.exact else None
        return off_policy_clip_loss(
            logp_BT, lp.of(self.alpha), adv, mask_BT, lo, hi, pi_k_logp_BT=pi_k, dual_clip_c=dual
        )


RatioFn = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Metrics]]
"""``fn(logp_BT, pi_old_logp_BT, adv, mask_BT) -> (loss_BT, metrics)``: a term of the ratio
``rho = pi/pi_old`` (losses.py ``rec_loss``, ``gspo_loss``)."""


@dataclass(frozen=True)
class PiOldTerm:
    """A term of ``rho = pi/pi_old`` (REC, GSPO, OPMD): ``fn`` with pi_old's log-probs, pi_old
    being pi_k under ``ratio_mode=exact``, else alpha."""

    fn: RatioFn
    pi_old: Role

    @property
    def needs(self) -> frozenset[Role]:
        return frozenset({self.pi_old})

    def __call__(
        self, logp_BT: Tensor, *, adv: Tensor, mask_BT: Tensor, lp: RoleLogprobs
    ) -> tuple[Tensor, Metrics]:
        return self.fn(logp_BT, lp.of(self.pi_old), adv, mask_BT)


def rec_term(c: GRPOConfig) -> PiOldTerm:
    """Group-relative REINFORCE (Yao et al.): ``-w(rho) * A * logp * M(rho, A)``, the mask
    ``grpo.loss.rec_clip`` and the weight ``grpo.loss.rec_weight``."""
    lo, hi = c.loss.clip_eps_low, c.loss.clip_eps_high
    ring_lo, ring_hi = c.loss.rec_ring_eps_low, c.loss.rec_ring_eps_high
    masks: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
        "none": rec_mask_none,
        "one_side": partial(rec_mask_one_side, eps_low=lo, eps_high=hi),
        "two_side": partial(rec_mask_two_side, eps_low=lo, eps_high=hi),
        "ring": partial(rec_mask_ring, eps_low=lo, eps_high=hi, ring_eps_low=ring_lo,
                        ring_eps_high=ring_hi),
    }  # fmt: skip
    weights: dict[str, Callable[[Tensor], Tensor]] = {
        "none": rec_weight_none,
        "is": rec_weight_is,
        "tis": partial(rec_weight_tis, eps_low=ring_lo, eps_high=ring_hi),
    }
    fn = partial(
        rec_loss, clip_mask_fn=masks[c.loss.rec_clip], weight_fn=weights[c.loss.rec_weight]
    )
    return PiOldTerm(fn, _pi_old(c))


def gspo_term(c: GRPOConfig) -> PiOldTerm:
    """GSPO (Zheng et al.): the sequence ratio ``exp(mean_t log(pi/pi_old))`` clipped."""
    return PiOldTerm(partial(gspo_loss, eps_low=c.loss.clip_eps_low, eps_high=c.loss.clip_eps_high),
                     _pi_old(c))  # fmt: skip


SURROGATES: dict[str, Callable[[GRPOConfig], LossTerm]] = {
    "off_policy_clip": OffPolicyClip.from_config,
    "rec": rec_term,
    "gspo": gspo_term,
}
"""``grpo.loss.policy_loss`` -> what builds its term from ``GRPOConfig``."""


# ------------------------------------------------------------ TIS weight and regularizers
@dataclass(frozen=True)
class TisWeight:
    """``grpo.off_policy.tis``: the detached weight ``cap(ratio)`` of the rollout mismatch, the
    ratio ``numerator / alpha_engine`` per token or per sequence; the numerator is pi_k, or
    alpha_trainer under ``grpo.off_policy.score_alpha`` (the numerics ratio alone)."""

    numerator: Role
    token_level: bool
    truncate: bool
    cap: float

    @classmethod
    def from_config(cls, c: GRPOConfig) -> TisWeight | None:
        if c.off_policy.tis == "none":
            return None
        if c.off_policy.ratio_mode != "exact" and not c.off_policy.score_alpha:
            raise ConfigError(
                f"grpo.off_policy.tis={c.off_policy.tis!r} needs grpo.off_policy.ratio_mode=exact "
                "(the trainer's pi_k log-probs): set grpo.off_policy.ratio_mode=exact or "
                "grpo.off_policy.tis=none."
            )
        numerator = Role.ALPHA_TRAINER if c.off_policy.score_alpha else Role.PI_K
        return cls(
            numerator,
            c.off_policy.tis.startswith("token"),
            c.off_policy.tis.endswith("truncate"),
            c.off_policy.tis_cap,
        )

    @property
    def needs(self) -> frozenset[Role]:
        return frozenset({self.numerator, Role.ALPHA_ENGINE})

    def __call__(self, *, mask_BT: Tensor, lp: RoleLogprobs) -> tuple[Tensor, Metrics]:
        ratio_fn = token_is_ratio if self.token_level else seq_is_ratio
        cap = self.cap

        def cap_fn(ratio: Tensor) -> Tensor:
            return truncate_weight(ratio, cap) if self.truncate else mask_weight(ratio, cap)

        return mismatch_tis_weight(lp.of(self.numerator), lp.of(Role.ALPHA_ENGINE), mask_BT,
                                   ratio_fn=ratio_fn, cap_fn=cap_fn)  # fmt: skip


@dataclass(frozen=True)
class AsymRE:
    """AsymRE: ``-c * logp`` (the advantages shifted by ``+c``)."""

    coef: float
    needs: ClassVar[frozenset[Role]] = frozenset()

    def __call__(
        self, logp_BT: Tensor, *, adv: Tensor, mask_BT: Tensor, lp: RoleLogprobs
    ) -> tuple[Tensor, Metrics]:
        return asymre_term(logp_BT, self.coef), {}


def _opmd(
    logp_BT: Tensor, pi_old_logp_BT: Tensor, adv: Tensor, mask_BT: Tensor, coef: float
) -> tuple[Tensor, Metrics]:
    return opmd_term(logp_BT, pi_old_logp_BT, coef), {}


def regularizer_of(c: GRPOConfig) -> LossTerm | None:
    """``grpo.loss.regularizer`` as a term, or None."""
    if c.loss.regularizer == "none" or c.loss.regularizer_coef == 0:
        return None
    if c.loss.regularizer == "asymre":
        return AsymRE(c.loss.regularizer_coef)
    if c.loss.regularizer == "opmd":
        return PiOldTerm(partial(_opmd, coef=c.loss.regularizer_coef), _pi_old(c))
    raise ValueError(f"grpo.loss.regularizer={c.loss.regularizer!r}: use none, asymre or opmd.")


# ------------------------------------------------------------------------------- the loss
@dataclass(frozen=True)
class PolicyLoss:
    """``surrogate * tis + regularizer`` per token; needs what its parts need."""

    surrogate: LossTerm
    tis: TisWeight | None = None
    regularizer: LossTerm | None = None

    @property
    def needs(self) -> frozenset[Role]:
        out = set(self.surrogate.needs)
        for part in (self.tis, self.regularizer):
            if part is not None:
                out |= part.needs
        return frozenset(out)

    def __call__(
        self, logp_BT: Tensor, *, adv: Tensor, mask_BT: Tensor, lp: RoleLogprobs
    ) -> tuple[Tensor, Metrics]:
        loss, metrics = self.surrogate(logp_BT, adv=adv, mask_BT=mask_BT, lp=lp)
        if self.tis is not None:
            w, tis_metrics = self.tis(mask_BT=mask_BT, lp=lp)
            loss = loss * w
            metrics.update(tis_metrics)
        if self.regularizer is not None:
            term, reg_metrics = self.regularizer(logp_BT, adv=adv, mask_BT=mask_BT, lp=lp)
            loss = loss + term
            metrics.update(reg_metrics)
        return loss, metrics


def build_policy_loss(grpo_cfg: GRPOConfig) -> PolicyLoss:
    """The policy loss of ``grpo_cfg``, composed once. Which log-probs play which role:
    docs/algorithms.md, "Which log-probs play which role"; under ``grpo.off_policy.score_alpha``
    alpha_trainer takes alpha's place in every ratio and TIS weighs it against
    alpha_engine (algorithms/staleness.py)."""
    c = grpo_cfg
    return PolicyLoss(surrogate_of(c), TisWeight.from_config(c), regularizer_of(c))


def surrogate_of(c: GRPOConfig) -> LossTerm:
    """``grpo.loss.policy_loss``: a built-in name, or a user's class ``path/to/file.py:Name`` /
    ``package.module:Name`` built as ``Name(grpo_cfg)``."""
    if c.loss.policy_loss in SURROGATES:
        return SURROGATES[c.loss.policy_loss](c)
    cls = load_object(
        c.loss.policy_loss, "loss", "class", "grpo.loss.policy_loss=mypkg.losses:MyLoss"
    )
    term = cls(c)
    if not isinstance(term, LossTerm) or not isinstance(term.needs, frozenset):
        raise ConfigError(
            f"grpo.loss.policy_loss={c.loss.policy_loss!r}: {cls.__name__}(grpo) must have "
            "`needs` (a frozenset of Role) and be called as term(logp_BT, adv=, mask_BT=, "
            "lp=) -> (loss_BT, metrics): see docs/algorithms.md, 'Write your own loss'."
        )
    return term
