"""The algorithm layer: policy losses, DPCC's threshold/LR controller, KL and advantages.

Pure torch (plus ``dpcc_megatron.config``); nothing here imports Megatron.

    from dpcc_megatron.algo import get_policy_loss
    loss, metrics = get_policy_loss("dpcc")(logprobs, old_logprobs, advantages, response_mask)

See docs/algorithm.md for the formulas.
"""
from .advantages import ADVANTAGE_MODES, group_advantages
from .aggregation import AGGREGATIONS, LossNormalizer, aggregate
from .controller import DPCCController
from .kl import KL_ESTIMATORS, kl_terms, kl_token_mean, ref_kl_penalty
from .metrics import METRIC_REDUCTIONS, combine_metrics
from .registry import (PolicyLoss, TokenInputs, TokenTerms, get_policy_loss, global_counts_needed,
                       list_policy_losses, register_policy_loss)
from .schedule import adaptive_threshold, drift_lr_factor, early_phase_cap, kl_target_scale
from .utilisation import sample_utilisation, token_gradients

# Importing the modules registers the built-in losses.
from . import losses as _losses  # noqa: F401,E402
from . import dpcc as _dpcc  # noqa: F401,E402
from . import cov_losses as _cov_losses  # noqa: F401,E402

__all__ = [
    "ADVANTAGE_MODES", "AGGREGATIONS", "DPCCController", "KL_ESTIMATORS", "LossNormalizer", "METRIC_REDUCTIONS",
    "PolicyLoss", "TokenInputs", "TokenTerms", "adaptive_threshold", "aggregate", "combine_metrics",
    "drift_lr_factor", "early_phase_cap", "kl_target_scale", "get_policy_loss", "global_counts_needed", "group_advantages",
    "kl_terms", "kl_token_mean", "list_policy_losses", "ref_kl_penalty", "register_policy_loss",
    "sample_utilisation", "token_gradients",
]
