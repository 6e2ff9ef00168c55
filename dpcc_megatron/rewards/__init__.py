"""Dual-track reward layer: rule checkers (base) + contrastive judge (advanced), combined.

Public API (what the trainer and the ``reward`` CLI use)::

    from dpcc_megatron.rewards import DualTrackReward, Sample

    reward = DualTrackReward(job_cfg.reward)
    samples = [Sample(prompt=p, response=r, task="addition", answer=a, group_id=g, response_ids=ids), ...]
    result = reward.score(samples)        # RewardResult: .total/.base/.advanced tensors, .metrics, ...
    reward.push_buffer(samples, result)   # older-policy opponents for the next batches
    ckpt["reward"] = reward.state_dict()  # and reward.load_state_dict(...) on resume

New checkers: ``@register_checker("name")`` on ``fn(sample, ctx, **params)`` (see
:mod:`.registry`), then list them under ``reward.tasks`` in the config.
This package never imports megatron; transformers only for the ``hf_rm`` judge.
"""
from . import checkers  # noqa: F401  (registers the built-in checkers; see .registry)
from .dual_track import DualTrackReward, RewardResult
from .judges import DeterministicJudge, HFRewardModelJudge, Judge, build_judge
from .jsonl import read_eval_set, read_samples
from .registry import CheckContext, CheckerTimeout, get_checker, list_checkers, register_checker, unregister_checker
from .sample import Sample, SampleError

__all__ = [
    "CheckContext", "CheckerTimeout", "DeterministicJudge", "DualTrackReward", "HFRewardModelJudge", "Judge",
    "RewardResult", "Sample", "SampleError", "build_judge", "get_checker", "list_checkers", "read_eval_set",
    "read_samples", "register_checker", "unregister_checker",
]
