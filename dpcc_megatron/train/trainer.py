"""The DPCC training loop, readable top to bottom.

Every rank runs :func:`train`. One iteration:

1. draw prompts (same on every rank; each data-parallel rank takes its share),
2. sample G responses per prompt with the policy itself (TP/PP collective),
3. score them with the dual-track reward (with dynamic sampling: repeat 1-3 until the batch
   holds enough groups whose rule rewards differ), compute group advantages,
4. recompute old-policy log-probs in the trainer (sampler log-probs kept for the mismatch metric),
5. K inner epochs of mini-batch updates with the DPCC controller and drift-aware LR,
6. log, send metrics to the monitor sidecar, act on its advice, checkpoint.

The run's parts (train/context.py): ``ctx.weights`` (the rollout engine and its refit, an explicit
step before the rollouts and inside each evaluation), ``ctx.checkpoints`` (save, resume, rollback),
``ctx.exchange`` (the monitor's advice), ``ctx.evaluator``. On every exit path (the end, a signal,
an early stop, an exception) :func:`.finish.finish` writes the records and closes the monitor, the
loggers and the engine; a refit that does not take or a dead engine (during rollouts or an
evaluation) first saves a checkpoint of the weights it stopped at, then stops every rank.
"""
from __future__ import annotations

import signal
import time

import torch

from ..algo import DPCCController, group_advantages
from ..config import JobConfig
from ..distributed import any_rank
from ..megatron.performance import gather_params, release_cached_memory, release_memory_enabled
from .async_rollout import RolloutPipeline
from .context import RunContext
from .control import MonitorControl
from .evaluate import evaluate_greedy
from .finish import finish
from .logging import ConsoleLogger
from .metrics import build_record
from .optimizers import build_optimizer, build_rl_optimizer, total_optimizer_steps
from .passes import old_logprobs, ref_logprobs, shared_logprob_stats
from .refit import EngineStop
from .rollout import RolloutBatch
from .setup import setup_run
from .sft import sft_batch
from .timing import PhaseTimer
from .update import policy_update, probe_drift, probe_samples, sft_update


class _Signals:
    """SIGTERM/SIGINT/SIGUSR1 ask for a checkpoint and a clean exit at the end of the iteration."""

    def __init__(self) -> None:
        self.requested = None
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            try:
                signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (tests)
                pass

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name


def warm_start(ctx: RunContext) -> None:
    """Supervised phase on the data's gold responses (train/sft.py), so RL starts from a nonzero reward."""
    cfg = ctx.cfg
    if cfg.train.warmup_sft_steps == 0:
        return
    optimizer = build_optimizer(ctx, lr=cfg.train.warmup_sft_lr)
    for step in range(cfg.train.warmup_sft_steps):
        batch = sft_batch(ctx, step)
        res = sft_update(ctx.chunks, optimizer, batch, cfg, dp_size=ctx.dp, dp_group=ctx.dp_group,
                         pp_group=ctx.pp_group, vocab_size=ctx.vocab_size)
        if ctx.rank == 0 and (step % 10 == 0 or step == cfg.train.warmup_sft_steps - 1):
            print(f" warm-start step {step + 1}/{cfg.train.warmup_sft_steps} | nll {res.metrics.get('pg_loss', 0):.4f}",
                  flush=True)


def train(cfg: JobConfig) -> dict:
    ctx = setup_run(cfg)
    summary: dict = {"alerts": []}
    try:
        _train(ctx, summary)
    except BaseException as e:  # the records so far and the summary are written, everything closed
        summary.update(stop_reason=f"failed: {type(e).__name__}: {e}", stop_kind="failed")
        try:
            finish(ctx, summary)
        except Exception:  # noqa: BLE001 - finish said what failed; the run's own error is the one to raise
            pass
        raise
    finish(ctx, summary)
    if ctx.rank == 0:
        print(f"[dpcc] {summary['stop_reason']}: reward {summary['reward_before']} -> {summary['reward_after']}",
              flush=True)
    return summary


def _train(ctx: RunContext, summary: dict) -> None:
    cfg = ctx.cfg
    signals = _Signals()
    log = ConsoleLogger(ctx)
    timer = PhaseTimer()  # time_*_s and peak memory in every record (train/timing.py)
    total_steps = total_optimizer_steps(cfg)
    controller = DPCCController(cfg.loss.dpcc, total_steps)
    control = MonitorControl(cfg.monitor)  # the LR scale the monitor's advice maintains
    consecutive_skips = 0
    # the rollouts in flight of a failed engine are not saved: the resumed run samples afresh
    engine_stop = EngineStop(ctx, lambda it: ctx.checkpoints.save(it, controller, summary, control))
    if cfg.loss.name == "dpcc":  # which DPCC ran: the calibrated default or the paper's literal method
        summary["dpcc_preset"] = cfg.loss.dpcc.preset
    dpcc_probe = cfg.loss.name == "dpcc" and cfg.loss.dpcc.drift_probe

    release = release_memory_enabled(cfg.train.release_memory_between_phases)
    ctx.engine.sleep()  # until its first refit the engine's GPU memory goes to the warm-start and the optimizers
    resumed = ctx.checkpoints.resume(controller)
    start_iteration = resumed.iteration
    if start_iteration == 0:
        warm_start(ctx)
        ctx.weights.moved()  # the warm-start moved the weights
        gather_params(ctx.chunks)
        if ctx.reference is not None and not cfg.loss.ref_model_path:
            ctx.reference.sync_from(ctx.chunks)  # the reference is the policy as RL starts
        build_rl_optimizer(ctx, total_steps)
        with engine_stop.at(None, "the evaluation before RL"):
            summary["reward_before"] = evaluate_greedy(ctx)  # refits the engine first
        if ctx.checkpoints.can_roll_back() and cfg.monitor.rollback_to_start:
            # the start: a first update that runs away goes back here (no Adam state exists yet)
            ctx.checkpoints.save(0, controller, summary, control, weights_only=True)
    else:
        summary["reward_before"] = resumed.state.get("reward_before")
        control.load_state_dict(resumed.state.get("monitor_control"))

    pipeline = RolloutPipeline(ctx)  # rollout.max_staleness (train/async_rollout.py)
    if start_iteration:
        pipeline.load_state_dict(resumed.in_flight, ctx)  # the checkpoint's rollouts in flight
    iteration = start_iteration
    stop_reason = "completed"
    stop_kind = "completed"
    while iteration < cfg.train.iterations:
        timer.start_iteration(ctx.engine)
        with timer.phase("checkpoint"):
            ctx.checkpoints.finalize_saves(blocking=False)  # asynchronous checkpoints whose writes finished
        t0 = time.time()
        with engine_stop.at(iteration, "rollouts"):  # a refit that did not take, or a dead engine: save, stop
            with timer.phase("rollout"):  # time_rollout_s is this phase less the refit (train/timing.py)
                # Refit: the engine takes the weights the last optimizer steps made (only when they changed).
                # An overlapping pipeline (rollout.max_staleness >= 1 with vLLM) refits it itself, when idle.
                if not pipeline.overlapping:
                    ctx.weights.refit()
                samples = pipeline.take(ctx, iteration)  # with rollout.dynamic_sampling: informative groups only
                pipeline.submit_ahead(ctx, iteration, cfg.train.iterations)  # max_staleness >= 1: the next rollouts
        if not pipeline.overlapping:  # an engine generating the next rollouts stays awake
            ctx.engine.sleep()  # give its memory to training until the next refit (vLLM on GPU; no-op otherwise)
        rollouts: RolloutBatch = samples.rollouts
        rewards = samples.rewards
        adv, adv_metrics = group_advantages(rewards.for_advantages, cfg.rollout.group_size, cfg.loss.advantage,
                                            cfg.loss.advantage_eps, per_component=cfg.loss.advantage_per_component,
                                            weights=rewards.weights)
        batch = samples.to_batch(adv)  # dynamic sampling's padding rows masked out
        with timer.phase("logprobs_old"):
            old_lp, entropy = old_logprobs(ctx, batch)
        batch.old_logprobs = old_lp if old_lp is not None else torch.zeros(batch.mask.shape)
        with timer.phase("logprobs_ref"):
            batch.ref_logprobs = ref_logprobs(ctx, batch)  # None without a reference model
        # mismatch_kl only where sampler and trainer held the same weights (else it is staleness: kl_behaviour)
        on_policy = samples.weight_version in (None, iteration)
        lp_stats = shared_logprob_stats(ctx, batch, rollouts, old_lp, entropy, on_policy)
        staleness = pipeline.staleness_fields(ctx, controller, samples, batch, iteration)  # tells DPCC kl_behaviour
        release_cached_memory(release)  # rollout -> training: the KV caches are gone

        timer.start("update")
        steps, step_metrics = 0, []
        mini = cfg.train.mini_batch_size // ctx.dp
        for epoch in range(cfg.train.inner_epochs):
            order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(
                cfg.train.seed * 7919 + iteration * 101 + epoch))
            for start in range(0, len(batch), mini):
                res = policy_update(ctx.chunks, ctx.optimizer, ctx.scheduler, controller,
                                    batch.select(order[start:start + mini]), cfg, dp_size=ctx.dp,
                                    dp_group=ctx.dp_group, pp_group=ctx.pp_group, vocab_size=ctx.vocab_size,
                                    monitor_lr_scale=control.lr_scale, fresh=steps == 0)
                steps += 1
                step_metrics.append(res)
                ctx.counters["steps_skipped" if res.skipped else "steps_taken"] += 1
                ctx.counters["fp16_overflows"] += int(res.overflow)
                # fp16 overflows while the loss scale settles are normal; only other skips count.
                consecutive_skips = consecutive_skips + 1 if (res.skipped and not res.overflow) else 0

        gather_params(ctx.chunks)  # overlapped param all-gather: full weights for rollout, eval and checkpoint
        ctx.weights.moved(any(not r.skipped for r in step_metrics))  # stale for the engine from here
        probe_kl = None
        # With one step the probe reads that step's own KL, which no in-step forward can see.
        one_step = steps == 1 and cfg.monitor.step_kl_probe
        if dpcc_probe or one_step:  # the drift the iteration's steps made
            first = order[:mini][:probe_samples(cfg, mini)]
            probe_kl = probe_drift(ctx.chunks, controller, batch.select(first), cfg, dp_size=ctx.dp,
                                   dp_group=ctx.dp_group, pp_group=ctx.pp_group, vocab_size=ctx.vocab_size,
                                   observe=dpcc_probe)
        release_cached_memory(release)  # training -> rollout: activations and grads' scratch are gone
        timer.stop("update")
        record = build_record(ctx, iteration, rollouts, rewards, adv_metrics, batch, lp_stats,
                              step_metrics, controller, time.time() - t0,
                              step_kl_after=probe_kl if one_step else None)
        record.update(samples.metrics)
        record.update(staleness)
        if ctx.evaluator is not None:  # the evaluation of the weights this iteration sampled with, if one ran
            record.update(ctx.evaluator.record_fields(iteration))
        record.update(timer.record_fields(ctx.engine))  # collective: peak memory over ranks
        if probe_kl is not None and dpcc_probe:  # DPCC's controller input (after several steps, not one step's KL)
            record["kl_probe"] = probe_kl
        log.line(record)
        advice = ctx.exchange.exchange(record)
        action = advice[0] if advice else None
        summary["alerts"] = list(ctx.exchange.alerts)
        iteration += 1
        ctx.consumed_samples += samples.prompts_drawn * cfg.rollout.group_size
        if action == "rollback" and ctx.counters["rollbacks"] >= cfg.monitor.max_rollbacks:
            if ctx.rank == 0:
                print(f"[dpcc] the monitor advised a rollback, but this run has rolled back "
                      f"{ctx.counters['rollbacks']} times (monitor.max_rollbacks): pausing instead", flush=True)
            action = "checkpoint_and_pause"
        if action == "rollback":  # a confirmed collapse: back to the last healthy checkpoint, more carefully
            back = ctx.checkpoints.rollback_to(advice[2], controller)
            if back is not None:
                ctx.weights.moved()  # the checkpoint's weights
                iteration = back
                pipeline.reset()  # rollouts of the abandoned weights are not trained on
                control.rolled_back()
                consecutive_skips = 0
                continue
            action = "checkpoint_and_pause"
        else:  # reduce_lr (a KL or high-entropy alert) cuts the LR at once; healthy stretches recover it
            control.apply(advice)

        if ctx.evaluator.due(iteration) and iteration < cfg.train.iterations:
            pipeline.wait_idle()  # a background generation finishes before the evaluation refits the engine
            with timer.phase("eval"), engine_stop.at(iteration, "an evaluation"):
                evaluate_greedy(ctx, iteration)  # eval.interval; the last iteration's runs below
        stop = any_rank(signals.requested is not None)
        if consecutive_skips >= cfg.train.max_consecutive_skips:
            stop_reason = f"stopped: {consecutive_skips} consecutive non-finite steps (see logs)"
            stop, stop_kind = True, "nonfinite"
        elif stop:
            stop_reason = f"stopped by {signals.requested or 'a signal on another rank'}"
            stop_kind = "signal"
        if action == "checkpoint_and_pause":
            stop_reason, stop, stop_kind = "paused by the monitor's advice", True, "paused"
        if cfg.train.exit_interval and iteration - start_iteration >= cfg.train.exit_interval \
                and iteration < cfg.train.iterations:
            stop_reason, stop = f"stopped by train.exit_interval after {cfg.train.exit_interval} iterations", True
            stop_kind = "exit_interval"
        interval = cfg.checkpoint.save_interval
        if cfg.checkpoint.dir and (stop or (interval and iteration % interval == 0)):
            with timer.phase("checkpoint"):
                ctx.checkpoints.save(iteration, controller, summary, control, pipeline)
        if stop:
            break

    if stop_kind == "signal":
        # The preemption window is for the checkpoint: no full greedy evaluation after it.
        summary["reward_after"] = None
        summary["final_eval"] = f"skipped: {stop_reason}"
    else:
        with timer.phase("eval"), engine_stop.at(iteration, "an evaluation"):
            summary["reward_after"] = evaluate_greedy(ctx, iteration)
    summary["eval"] = ctx.evaluator.last
    summary.update(iterations=iteration, stop_reason=stop_reason, stop_kind=stop_kind, kl_last=controller.last_kl,
                   tau_last=controller.tau, lr_factor_last=controller.lr_factor,
                   steps_taken=ctx.counters["steps_taken"], steps_skipped=ctx.counters["steps_skipped"],
                   prompts_truncated=ctx.counters["prompts_truncated"], rollbacks=ctx.counters["rollbacks"],
                   advice_fallbacks=ctx.counters["advice_fallbacks"], lr_scale_from_monitor=control.lr_scale,
                   lr_recoveries=control.recoveries)
    if cfg.checkpoint.dir and iteration == cfg.train.iterations and not (
            cfg.checkpoint.save_interval and iteration % cfg.checkpoint.save_interval == 0):
        with timer.phase("checkpoint"):
            ctx.checkpoints.save(iteration, controller, summary, control, pipeline)
    pipeline.close()
    with timer.phase("checkpoint"):
        ctx.checkpoints.finalize_saves(blocking=True)  # the last checkpoint is complete (and `latest` names it)
    summary.update(timer.after_last_record())
