# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The research harness's training: the stopping rule (`converged`), the (compiled) training step, and the loop that
trains a model until the rule says stop."""

import collections
import functools
import math
import resource
import time

import torch

from settings import Settings


def on_plateau(best_validation_loss: float, plateau: float, settings: Settings) -> bool:
    """Whether a needle run has not left the 1/N plateau: its best validation loss is above `plateau_fraction` x
    `plateau` (`plateau_loss`, the loss of a model that retrieves without matching keys)."""
    return best_validation_loss > settings.plateau_fraction * plateau


def extended_cap(max_steps: int, settings: Settings, plateau: float | None, min_steps: int = 0) -> int:
    """The step cap of a run that is still on the plateau at `max_steps`: `settings.plateau_max_steps` where set (and
    the run has a plateau and is not a fixed-length run, `min_steps < max_steps`), else `max_steps`."""
    if plateau is None or settings.plateau_max_steps is None or min_steps >= max_steps:
        return max_steps
    return max(max_steps, settings.plateau_max_steps)


def converged(
    eval_steps, validation_losses, min_steps: int, max_steps: int, settings: Settings, plateau: float | None = None
) -> bool:
    """The stopping rule: stop at the step cap, or, from `min_steps` on, when the best validation loss inside the last
    `window_fraction` of the steps so far is not better than the best before that window by at least
    max(`min_relative_improvement` x that best, `min_absolute_improvement`); but never, before the cap, while the
    best validation loss is still on the task's plateau (above `plateau_fraction` x `plateau`, the loss of a model
    that retrieves without matching keys: `plateau_loss`), where a flat curve can still drop."""
    step = eval_steps[-1]
    if step >= max_steps:
        # issue 38: a run still on the plateau at the cap goes on to `plateau_max_steps` (every architecture alike),
        # and within it the rule below applies as before
        cap = extended_cap(max_steps, settings, plateau, min_steps)
        if step >= cap:
            return True
        best_at_cap = min(loss for s, loss in zip(eval_steps, validation_losses) if s <= max_steps)
        if not on_plateau(best_at_cap, plateau, settings):
            return True  # it had left the plateau by the cap: stopped there, as without the extension
    if step < min_steps:
        return False
    if plateau is not None and on_plateau(min(validation_losses), plateau, settings):
        return False
    window_start = step * (1 - settings.window_fraction)
    before = [loss for s, loss in zip(eval_steps, validation_losses) if s <= window_start]
    inside = [loss for s, loss in zip(eval_steps, validation_losses) if s > window_start]
    if not before or not inside:
        return False
    best_before = min(before)
    needed = max(settings.min_relative_improvement * best_before, settings.min_absolute_improvement)
    return min(inside) > best_before - needed


def answer_logits(model, input_ids: torch.Tensor, answer_rows: torch.Tensor, answer_columns: torch.Tensor):
    """The fp32 logits `[R, vocab]` of the model's next-token prediction at the R scored positions
    (`input_ids [B, T]`, `answer_rows` and `answer_columns` `[R]`): the decoder runs on every token, the LM head only
    where a loss or an accuracy is read (a needle batch scores a few positions per example)."""
    hidden_states = model.model(input_ids=input_ids).last_hidden_state
    return model.lm_head(hidden_states[answer_rows, answer_columns]).float()


def training_logits_function(model, settings: Settings):
    """`answer_logits` of `model` as a function of the batch tensors, for the training steps: compiled by
    `torch.compile` (static shapes: one graph for the forward, one for its backward) when `settings.compile`, else
    eager."""
    function = functools.partial(answer_logits, model)
    if not settings.compile:
        return function
    torch._dynamo.reset()  # a fresh cache per model: recompilations of earlier jobs never count against the limit
    return torch.compile(function, fullgraph=True, dynamic=False)


def make_training_step(model, lr: float, settings: Settings):
    """One optimizer step on a batch, as `train_to_convergence` runs it (and `bench_speed.py` times it): the
    cross-entropy of `training_logits_function`'s logits against the answers, backward, gradient clipping (foreach),
    AdamW (fused; betas 0.9/0.95). Returns `(step, optimizer)`: `step(batch)` takes a batch on the model's device and
    returns the loss (a 0-dim tensor, not synchronised); the optimizer is for a learning-rate scheduler."""
    logits_of = training_logits_function(model, settings)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay, fused=True
    )
    parameters = list(model.parameters())

    def step(batch: dict) -> torch.Tensor:
        logits = logits_of(batch["input_ids"], batch["answer_rows"], batch["answer_columns"])
        loss = torch.nn.functional.cross_entropy(logits, batch["answers"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, settings.grad_clip, foreach=True)
        optimizer.step()
        return loss

    return step, optimizer


def to_device(batch: dict, device: str) -> dict:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


@torch.no_grad()
def evaluate_answers(logits_of, batch: dict) -> dict:
    """Mean loss over the answers of `batch` and, for a needle batch, the greedy accuracy per needle count over all
    queries and over the first query of each example (`{"loss", "accuracy": {N: acc}, "first_query": {N: acc}}`)."""
    logits = logits_of(batch["input_ids"], batch["answer_rows"], batch["answer_columns"])
    result = {"loss": torch.nn.functional.cross_entropy(logits, batch["answers"]).item()}
    if "needle_count" in batch:
        hits = (logits.argmax(-1) == batch["answers"]).float()
        first = batch["query_index"] == 0
        counts = batch["needle_count"]
        result["accuracy"] = {str(n): hits[counts == n].mean().item() for n in counts.unique().tolist()}
        result["first_query"] = {str(n): hits[(counts == n) & first].mean().item() for n in counts.unique().tolist()}
    return result


def train_to_convergence(
    model, next_batch, validation_batch: dict, lr: float, min_steps: int, max_steps: int, eval_every: int,
    settings: Settings, progress=None, plateau: float | None = None,
) -> dict:
    """AdamW (fused), linear warmup then a constant learning rate, gradient clipping; the validation loss every
    `eval_every` steps; stops by `converged`. The model ends with the weights of its best validation loss (early
    stopping). `next_batch()` returns a batch on the CPU (dict of tensors with the answers' fields); `model` and
    `validation_batch` are on `settings.device`. `progress(step, validation)`, when given, is called at every
    evaluation."""
    training_step, optimizer = make_training_step(model, lr, settings)
    evaluation_logits_of = functools.partial(answer_logits, model)  # eager: a compiled graph costs more than it saves
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / settings.warmup_steps))
    model.train()
    eval_steps, validation_losses, validation_accuracies = [], [], []
    recent_train_losses = collections.deque(maxlen=eval_every)  # bounded: a long run keeps only these
    best_loss, best_state, best_step = math.inf, None, 0
    step = 0
    final_cap = extended_cap(max_steps, settings, plateau, min_steps)
    started_wall, started_cpu = time.perf_counter(), time.thread_time()
    while True:
        loss = training_step(to_device(next_batch(), settings.device))
        scheduler.step()
        recent_train_losses.append(loss.detach())
        step += 1
        if step == 1:  # the first step compiles: its time is kept apart from the steps per second
            first_step_wall, first_step_cpu = time.perf_counter() - started_wall, time.thread_time() - started_cpu
        if step % eval_every == 0 or step == max_steps or step >= final_cap:
            model.eval()
            validation = evaluate_answers(evaluation_logits_of, validation_batch)
            model.train()
            if not math.isfinite(validation["loss"]):
                raise RuntimeError(f"non-finite validation loss at step {step}")
            eval_steps.append(step)
            validation_losses.append(validation["loss"])
            if "accuracy" in validation:
                validation_accuracies.append({"all": validation["accuracy"], "first": validation["first_query"]})
            if progress is not None:
                progress(step, validation)
            if validation["loss"] < best_loss:
                best_loss, best_step = validation["loss"], step
                best_state = {name: value.detach().clone() for name, value in model.state_dict().items()}
            if converged(eval_steps, validation_losses, min_steps, max_steps, settings, plateau):
                break
    loop_wall, loop_cpu = time.perf_counter() - started_wall, time.thread_time() - started_cpu
    model.load_state_dict(best_state)
    model.eval()
    return {
        "steps": step,
        # seconds of the first step (compilation) and steps per second of the others, validations included
        "first_step_seconds": first_step_wall,
        "steps_per_second": (step - 1) / max(loop_wall - first_step_wall, 1e-9),
        "steps_per_cpu_second": (step - 1) / max(loop_cpu - first_step_cpu, 1e-9),
        "hit_cap": step >= max_steps,
        "extended_past_cap": step > max_steps,  # issue 38's plateau extension (`extended_cap`) ran
        # the worker process's peak resident memory so far (MB): a long run that grows shows here
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "best_step": best_step,
        "best_validation_loss": best_loss,
        "eval_steps": eval_steps,
        "validation_losses": validation_losses,
        # per eval: {"all": {N: accuracy over every query}, "first": {N: accuracy of the first query}} (needle task)
        "validation_accuracy": validation_accuracies,
        "final_train_loss": torch.stack(list(recent_train_losses)).mean().item(),
    }
