# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The research harness's runner: jobs (one training run each, in a worker process), the learning-rate sweep and the
runs after it, the pool that runs them, and the environment a run records."""

import dataclasses
import json
import multiprocessing
import os
import platform
import subprocess
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch
import transformers

from evaluation import attention_statistics, needle_accuracy, stream_perplexity
from model_shapes import build_model, count_parameters
from modeling_dint import DintForCausalLM
from settings import ARCHITECTURES, REPO_ROOT, Settings, lm_hidden, settings_from_dict
from tasks import (
    NeedleVocabulary,
    load_corpus,
    make_lm_batch,
    make_mixed_needle_batch,
    make_needle_batch,
    needle_test_set,
    next_token_batch,
    plateau_loss,
    validation_needle_counts,
)
from training import to_device, train_to_convergence


def job_id(job: dict) -> str:
    return f"{job['phase']}/{job['task']}/{job['kind']}/h{job['hidden']}/T{job['context']}/lr{job['lr']:g}/s{job['seed']}"


def run_job(job: dict, settings_dict: dict) -> dict:
    """One training run to convergence and its evaluation; deterministic given the job (its seeds), whatever process
    or order runs it."""
    torch.set_num_threads(1)
    settings = settings_from_dict(settings_dict)
    started = time.time()
    if job["task"] == "needle":
        record = run_needle_job(job, settings)
    else:
        record = run_lm_job(job, settings)
    record.update(job)
    record["id"] = job_id(job)
    # what the run ran on and with (records before 2026-11-27 name none of it: the CPU, compiled, the journal's
    # summary's releases)
    record["device"] = device_name(settings.device)
    record.update(compile=settings.compile, torch=torch.__version__, transformers=transformers.__version__)
    record["seconds"] = time.time() - started
    return record



def device_name(device: str) -> str:
    """"cpu", or the GPU's name (`torch.cuda.get_device_name`): what a record names as its device."""
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def run_needle_job(job: dict, settings: Settings) -> dict:
    vocab = NeedleVocabulary(settings.key_vocab, settings.value_vocab, settings.filler_vocab)
    kind, hidden, context, seed = job["kind"], job["hidden"], job["context"], job["seed"]
    model = build_model(kind, vocab.size, context * max(settings.length_factors), settings, hidden, seed)
    model.to(settings.device)
    data_generator = torch.Generator().manual_seed(seed)
    counts = validation_needle_counts(settings)
    validation = make_mixed_needle_batch(
        torch.Generator().manual_seed(settings.validation_seed + context), settings.validation_examples * len(counts),
        context, counts, vocab, settings.needle_layout,
    )
    fixed_steps = {"long": settings.long_steps, "pilot": settings.pilot_steps}.get(job["phase"])

    def progress(step, validation):  # a pilot runs for long: it says how it goes
        print(f"  {job_id(job)} step {step}: validation loss {validation['loss']:.4f}, accuracy per N (every query / "
              "first query) " + " ".join(f"{n}: {a:.2f}/{validation['first_query'][n]:.2f}"
                                         for n, a in validation["accuracy"].items()), flush=True)

    history = train_to_convergence(
        model,
        lambda: make_mixed_needle_batch(data_generator, settings.needle_batch, context, settings.train_needle_counts,
                                        vocab, settings.needle_layout),
        to_device(validation, settings.device),
        job["lr"],
        fixed_steps or settings.min_steps,
        fixed_steps or settings.max_steps,
        settings.pilot_eval_every if job["phase"] == "pilot" else settings.eval_every,
        settings,
        progress if job["phase"] == "pilot" else None,
        plateau_loss(settings),
    )
    record = {"parameters": count_parameters(model), **history}
    if job["phase"] in ("sweep", "pilot"):
        return record
    record["accuracy"], record["first_query_accuracy"] = {}, {}
    for factor in settings.length_factors:
        record["accuracy"][str(factor)], record["first_query_accuracy"][str(factor)] = {}, {}
        for count in settings.needle_counts:
            every_query, first_query = needle_accuracy(
                model, needle_test_set(settings, vocab, context * factor, count), settings.device
            )
            record["accuracy"][str(factor)][str(count)] = every_query
            record["first_query_accuracy"][str(factor)][str(count)] = first_query
    analysis = make_needle_batch(
        torch.Generator().manual_seed(settings.test_seed - 1), settings.analysis_examples, context,
        settings.analysis_needles, vocab, layout=settings.needle_layout,
    )
    statistics, maps = attention_statistics(model, kind, analysis)
    record.update(statistics)
    if isinstance(model, DintForCausalLM) and model.config.differential_attention == "v1":
        record["lambda_full"] = [layer.self_attn.lambda_full().item() for layer in model.model.layers]
    if seed == settings.seeds[0]:
        record["example_maps"] = maps
    return record


def run_lm_job(job: dict, settings: Settings) -> dict:
    corpus = load_corpus(settings)
    kind, hidden, seed = job["kind"], job["hidden"], job["seed"]
    model = build_model(kind, corpus["vocab_size"], settings.lm_context, settings, hidden, seed)
    model.to(settings.device)
    data_generator = torch.Generator().manual_seed(seed)
    window_count = (len(corpus["validation"]) - 1) // settings.lm_context
    windows = corpus["validation"][: window_count * settings.lm_context].view(window_count, settings.lm_context)
    history = train_to_convergence(
        model,
        lambda: make_lm_batch(data_generator, corpus["train"], settings.lm_batch, settings.lm_context),
        to_device(next_token_batch(windows), settings.device),
        job["lr"],
        settings.lm_min_steps,
        settings.lm_max_steps,
        settings.lm_eval_every,
        settings,
    )
    record = {"parameters": count_parameters(model), **history}
    if job["phase"] != "sweep":
        record["test_perplexity"] = stream_perplexity(model, corpus["test"], settings.lm_context, settings.device)
    return record


def job_cost(job: dict, settings: Settings) -> float:
    """Rough relative cost, to start the longest jobs first (it only orders the queue)."""
    if job["task"] == "lm":
        return 3.5 * settings.lm_max_steps * (job["hidden"] / 64) ** 1.5
    steps = {"long": settings.long_steps, "pilot": settings.pilot_steps}.get(job["phase"], settings.max_steps)
    return steps * (job["hidden"] / 64) ** 1.5 * (job["context"] / 64) ** 1.2


def sweep_jobs(settings: Settings) -> list[dict]:
    shortest = min(context for _, context in settings.needle_configs)
    jobs = [
        dict(phase="sweep", task="needle", kind=kind, hidden=hidden, context=shortest, lr=lr, seed=settings.sweep_seed)
        for hidden in sorted({hidden for hidden, _ in settings.needle_configs})
        for kind in ARCHITECTURES
        for lr in settings.learning_rates
    ]
    hidden, _ = settings.needle_configs[0]
    jobs += [
        dict(phase="sweep", task="needle", kind=kind, hidden=hidden, context=shortest, lr=lr, seed=settings.sweep_seed)
        for kind in settings.controls
        for lr in settings.learning_rates
    ]
    if len(settings.lm_learning_rates) > 1:
        jobs += [
            dict(phase="sweep", task="lm", kind=kind, hidden=lm_hidden(settings), context=settings.lm_context, lr=lr,
                 seed=settings.sweep_seed)
            for kind in ARCHITECTURES
            for lr in settings.lm_learning_rates
        ]
    return jobs


def choose_learning_rates(sweep: list[dict], settings: Settings) -> dict:
    """Per (task, architecture, hidden): the swept learning rate with the lowest best validation loss."""
    chosen = {}
    for record in sweep:
        key = f"{record['task']}/{record['kind']}/h{record['hidden']}"
        if key not in chosen or record["best_validation_loss"] < chosen[key][1]:
            chosen[key] = (record["lr"], record["best_validation_loss"])
    if len(settings.lm_learning_rates) == 1:
        for kind in ARCHITECTURES:
            chosen[f"lm/{kind}/h{lm_hidden(settings)}"] = (settings.lm_learning_rates[0], None)
    return {key: lr for key, (lr, _) in chosen.items()}


def main_jobs(settings: Settings, learning_rates: dict) -> list[dict]:
    jobs = [
        dict(phase="main", task="needle", kind=kind, hidden=hidden, context=context,
             lr=learning_rates[f"needle/{kind}/h{hidden}"], seed=seed)
        for hidden, context in settings.needle_configs
        for kind in ARCHITECTURES
        for seed in settings.seeds
    ]
    hidden, context = settings.ablation_config
    jobs += [
        dict(phase="ablation", task="needle", kind=kind, hidden=hidden, context=context,
             lr=learning_rates[f"needle/dint/h{hidden}"], seed=seed)
        for kind in settings.ablations
        for seed in settings.seeds
    ]
    hidden, context = settings.needle_configs[0]
    jobs += [
        dict(phase="control", task="needle", kind=kind, hidden=hidden, context=context,
             lr=learning_rates[f"needle/{kind}/h{hidden}"], seed=seed)
        for kind in settings.controls
        for seed in settings.seeds
    ]
    jobs += [
        dict(phase="long", task="needle", kind=kind, hidden=hidden, context=context,
             lr=learning_rates[f"needle/{kind}/h{hidden}"], seed=settings.seeds[0])
        for kind in settings.long_kinds
    ]
    jobs += [
        dict(phase="main", task="lm", kind=kind, hidden=lm_hidden(settings), context=settings.lm_context,
             lr=learning_rates[f"lm/{kind}/h{lm_hidden(settings)}"], seed=seed)
        for kind in ARCHITECTURES
        for seed in settings.lm_seeds
    ]
    return jobs


def run_jobs(jobs: list[dict], settings: Settings, journal: Path, done: dict, log) -> list[dict]:
    """Runs the jobs not in `done` (id -> record) on a pool of `settings.workers` spawned processes, longest first;
    appends each finished record to `journal`; returns the records in the order of `jobs`."""
    pending = sorted((job for job in jobs if job_id(job) not in done), key=lambda job: -job_cost(job, settings))
    settings_dict = dataclasses.asdict(settings)
    if pending:
        log(f"{len(pending)} jobs to run ({len(jobs) - len(pending)} already done)")
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=settings.workers, mp_context=context) as pool:
            futures = {pool.submit(run_job, job, settings_dict): job for job in pending}
            remaining = set(futures)
            while remaining:
                finished, remaining = wait(remaining, return_when=FIRST_COMPLETED)
                for future in finished:
                    record = future.result()
                    done[record["id"]] = record
                    with journal.open("a") as handle:
                        handle.write(json.dumps(record) + "\n")
                    summary = f"steps {record['steps']}{' (cap)' if record['hit_cap'] else ''}, best val loss {record['best_validation_loss']:.4f}"
                    if "accuracy" in record:
                        summary += ", acc 1x " + " ".join(f"{v:.2f}" for v in record["accuracy"]["1"].values())
                    if "test_perplexity" in record:
                        summary += f", test ppl {record['test_perplexity']:.1f}"
                    log(f"done {record['id']}: {summary} ({record['seconds']:.0f} s); {len(remaining)} left")
    return [done[job_id(job)] for job in jobs]


def pilot_jobs(settings: Settings) -> list[dict]:
    hidden, context = settings.needle_configs[0]
    return [
        dict(phase="pilot", task="needle", kind=kind, hidden=hidden, context=context, lr=lr, seed=settings.sweep_seed)
        for kind in settings.pilot_kinds
        for lr in settings.pilot_learning_rates
    ]


def run_experiment(settings: Settings, out: Path, resume: bool, log) -> dict:
    journal = out / "jobs.jsonl"
    done = {}
    if resume and journal.exists():
        for line in journal.read_text().splitlines():
            record = json.loads(line)
            done[record["id"]] = record
    elif journal.exists():
        journal.unlink()
    sweep = run_jobs(sweep_jobs(settings), settings, journal, done, log)
    learning_rates = choose_learning_rates(sweep, settings)
    log("chosen learning rates: " + ", ".join(f"{k} {v:g}" for k, v in learning_rates.items()))
    records = run_jobs(main_jobs(settings, learning_rates), settings, journal, done, log)
    return {"sweep": sweep, "learning_rates": learning_rates, "runs": records}


def environment() -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "research/*.py", "modeling_dint"], cwd=REPO_ROOT,
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", ""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "git_commit": commit + (" (with uncommitted changes to the harness or modeling_dint)" if dirty else ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }
