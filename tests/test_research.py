"""The research harness in research/ (run.py and its modules): its synthetic needle task, its equal-size
models, its convergence rule and statistics, the determinism of a job, and (slow) the whole --quick pipeline down to a
complete report with finite numbers."""

import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch


REPO_ROOT = Path(__file__).resolve().parents[1]
RESEARCH_DIR = REPO_ROOT / "research"


# The harness's modules, imported by name from their folder (not from a file spec) so that the spawned worker processes
# can import them too.
if str(RESEARCH_DIR) not in sys.path:
    sys.path.insert(0, str(RESEARCH_DIR))
import decision_rule  # noqa: E402
import evaluation  # noqa: E402
import model_shapes  # noqa: E402
import run  # noqa: E402
import runner  # noqa: E402
import settings as presets  # noqa: E402
import tasks  # noqa: E402
import training  # noqa: E402


def test_the_harness_is_imported_from_its_folder():
    for module in (decision_rule, evaluation, model_shapes, presets, run, runner, tasks, training):
        assert Path(module.__file__).resolve().parent == RESEARCH_DIR, module


def test_pairs_first_needle_batch_layout():
    """Zoology's multi-query associative recall: the key-value pairs side by side first, then each key once more, as
    its own query, at a random place in the filler after them; the answer is the key's value and is not in the input
    after the query."""
    vocab = tasks.NeedleVocabulary(key_vocab=8, value_vocab=8, filler_vocab=16)
    batch = tasks.make_needle_batch(torch.Generator().manual_seed(0), 32, 40, 4, vocab)
    input_ids = batch["input_ids"]
    assert input_ids.shape == batch["filler"].shape == batch["needles"].shape == (32, 40)
    assert all(batch[field].shape == (32 * 4,) for field in tasks.ANSWER_FIELDS)
    again = tasks.make_needle_batch(torch.Generator().manual_seed(0), 32, 40, 4, vocab)
    assert all(torch.equal(batch[key], again[key]) for key in batch)
    for row in range(32):
        tokens = input_ids[row].tolist()
        pairs = dict(zip(tokens[0:8:2], tokens[1:8:2]))
        assert all(vocab.first_key <= key < vocab.first_value for key in pairs)
        assert all(vocab.first_value <= value < vocab.first_filler for value in pairs.values())
        assert len(pairs) == 4 and len(set(pairs.values())) == 4  # distinct keys and values
        assert batch["needles"][row].tolist() == [True] * 8 + [False] * 32
        answers = (batch["answer_rows"] == row).nonzero().flatten()
        columns = batch["answer_columns"][answers].tolist()
        assert batch["query_index"][answers].tolist() == [0, 1, 2, 3]
        assert columns == sorted(columns) and len(set(columns)) == 4 and min(columns) >= 8
        assert sorted(tokens[column] for column in columns) == sorted(pairs)  # every key queried once
        for answer, column in zip(answers.tolist(), columns):
            start, value_position = batch["needle_start"][answer].item(), batch["value_position"][answer].item()
            assert tokens[start] == tokens[column] and value_position == start + 1
            assert batch["answers"][answer].item() == pairs[tokens[column]] == tokens[value_position]
        assert not set(pairs.values()) & set(tokens[8:])  # no answer after the pairs
        filler = batch["filler"][row].tolist()
        assert sum(filler) == 40 - 2 * 4 - 4 and not any(filler[column] for column in columns)
        assert all(vocab.first_filler <= t < vocab.size for t, f in zip(tokens, filler) if f)
    with pytest.raises(ValueError, match="`layout` must be one of"):
        tasks.make_needle_batch(torch.Generator(), 2, 40, 4, vocab, layout="zoology")


def test_haystack_needle_batch_layout():
    vocab = tasks.NeedleVocabulary(key_vocab=8, value_vocab=8, filler_vocab=16)
    batch = tasks.make_needle_batch(torch.Generator().manual_seed(0), 32, 40, 4, vocab, layout="haystack")
    input_ids = batch["input_ids"]
    assert input_ids.shape == batch["filler"].shape == (32, 40)
    assert all(batch[field].shape == (32 * 4,) for field in tasks.ANSWER_FIELDS)
    # same seed, same examples (the data order every architecture shares)
    again = tasks.make_needle_batch(torch.Generator().manual_seed(0), 32, 40, 4, vocab, layout="haystack")
    assert all(torch.equal(batch[key], again[key]) for key in batch)
    for row in range(32):
        tokens = input_ids[row].tolist()
        needle_starts = [i for i, t in enumerate(tokens) if t == vocab.needle_marker]
        assert len(needle_starts) == 4 and needle_starts == sorted(needle_starts)
        needles = {tokens[i + 1]: tokens[i + 2] for i in needle_starts}
        assert len(needles) == 4 and len(set(needles.values())) == 4  # distinct keys and values
        # the query section: QUERY key, one per needle, every needle once; the answers are not in the input
        assert tokens[-8::2] == [vocab.query_marker] * 4 and sorted(tokens[-7::2]) == sorted(needles)
        assert not set(needles.values()) & set(tokens[-8:])
        answers = (batch["answer_rows"] == row).nonzero().flatten()
        assert batch["query_index"][answers].tolist() == [0, 1, 2, 3]
        for answer in answers.tolist():
            key_position = batch["answer_columns"][answer].item()
            start = batch["needle_start"][answer].item()
            assert tokens[key_position - 1] == vocab.query_marker
            assert tokens[start : start + 2] == [vocab.needle_marker, tokens[key_position]]
            assert batch["answers"][answer].item() == needles[tokens[key_position]] == tokens[start + 2]
            assert batch["value_position"][answer].item() == start + 2
        assert batch["needles"][row].tolist() == [any(s <= i < s + 3 for s in needle_starts) for i in range(40)]
        filler = batch["filler"][row].tolist()
        assert sum(filler) == 40 - 3 * 4 - 2 * 4
        assert all(vocab.first_filler <= t < vocab.size for t, f in zip(tokens, filler) if f)


def test_needle_batch_with_teacher_forced_answers():
    """The paper's query format (`QUERY key value`), which `elimination_check.py` trains on: the answer follows its
    key in the input."""
    vocab = tasks.NeedleVocabulary(key_vocab=8, value_vocab=8, filler_vocab=16)
    batch = tasks.make_needle_batch(torch.Generator().manual_seed(2), 16, 40, 4, vocab, query_count=2,
                                      answers_in_input=True, layout="haystack")
    assert batch["answers"].shape == (16 * 2,)
    columns = batch["answer_columns"]
    assert torch.equal(batch["input_ids"][batch["answer_rows"], columns + 1], batch["answers"])
    assert torch.equal(batch["input_ids"][batch["answer_rows"], columns - 1],
                       torch.full_like(columns, vocab.query_marker))
    assert (columns == 40 - 6 + 1).sum() == 16 and (columns == 40 - 3 + 1).sum() == 16
    with pytest.raises(ValueError, match="cannot hold"):
        tasks.make_needle_batch(torch.Generator(), 2, 19, 4, vocab, layout="haystack")  # 4 needles, 4 queries: 20
    with pytest.raises(ValueError, match="cannot hold"):
        tasks.make_needle_batch(torch.Generator(), 2, 11, 4, vocab)  # pairs first: 4 pairs and 4 queries need 12


def test_mixed_needle_batch_has_each_needle_count():
    vocab = tasks.NeedleVocabulary(key_vocab=32, value_vocab=32, filler_vocab=64)
    for layout, width in (("pairs_first", 2), ("haystack", 3)):
        batch = tasks.make_mixed_needle_batch(torch.Generator().manual_seed(1), 32, 64, (1, 2, 4, 6), vocab, layout)
        assert batch["input_ids"].shape == (32, 64)
        needles = (batch["needles"].sum(-1) // width).tolist()
        assert needles == [1] * 8 + [2] * 8 + [4] * 8 + [6] * 8
        # every needle queried: N answers per row, in the row's own place
        assert torch.bincount(batch["answer_rows"]).tolist() == needles
        assert torch.equal(batch["needle_count"], torch.tensor(needles)[batch["answer_rows"]])
        assert torch.equal(batch["input_ids"][batch["answer_rows"], batch["value_position"]], batch["answers"])


def test_answer_logits_are_the_models_logits():
    """The harness's loss reads the LM head at the answers only: the same logits as the model's full forward, and on
    a next-token batch the same loss as the model's own causal-LM loss."""
    settings = presets.quick_settings()
    vocab = tasks.NeedleVocabulary(settings.key_vocab, settings.value_vocab, settings.filler_vocab)
    batch = tasks.make_mixed_needle_batch(torch.Generator().manual_seed(4), 8, 32, (1, 2, 4, 6), vocab)
    for kind in ("transformer", "dint"):
        model = model_shapes.build_model(kind, vocab.size, 64, settings, 16, 0).eval()
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"]).logits
            picked = training.answer_logits(model, batch["input_ids"], batch["answer_rows"], batch["answer_columns"])
            torch.testing.assert_close(picked, logits[batch["answer_rows"], batch["answer_columns"]].float())
            lm = tasks.next_token_batch(batch["input_ids"])
            loss = torch.nn.functional.cross_entropy(
                training.answer_logits(model, lm["input_ids"], lm["answer_rows"], lm["answer_columns"]), lm["answers"]
            )
            reference = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            torch.testing.assert_close(loss, reference)


@pytest.mark.parametrize("preset", ["quick_settings", "Settings", "gpu_settings"])
def test_architectures_have_equal_size(preset):
    settings = getattr(presets, preset)()
    hidden = settings.needle_configs[0][0]
    counts = {
        kind: model_shapes.count_parameters(model_shapes.build_model(kind, 100, 64, settings, hidden, 0))
        for kind in ("transformer", "transformer_per_map", "diff", "dint")
    }
    layers, head_dim = settings.num_hidden_layers, settings.head_dim
    # DIFF/DINT = the Transformer with one head per softmax map (the same projections) + 4 lambda vectors and a
    # head-norm weight of 2*head_dim per layer
    assert counts["diff"] == counts["dint"] == counts["transformer_per_map"] + layers * (4 * head_dim + 2 * head_dim)
    no_norm = model_shapes.build_model("no_head_norm", 100, 64, settings, hidden, 0)
    assert model_shapes.count_parameters(no_norm) == counts["transformer_per_map"] + layers * 4 * head_dim
    # the Transformer with one head per differential head: the missing heads' projections moved into its SwiGLU, to
    # within one intermediate channel (3 * hidden parameters) per layer
    heads, width = model_shapes.transformer_shape("transformer", settings, hidden)
    assert heads == settings.attention_heads // 2 and width > settings.mlp_ratio * hidden
    assert 0 <= counts["transformer_per_map"] - counts["transformer"] < layers * 3 * hidden


@pytest.mark.parametrize("hidden", [64, 128])
def test_comparison_architectures_have_equal_size(hidden):
    """Issue 38's comparison: every kind within one SwiGLU channel per layer of DIFF-V1's parameter count; hidden 128
    has 4 softmax maps per layer; V2 has 2h query heads of head_dim, h KV heads, and no head norm."""
    settings = presets.comparison_settings(hidden)
    assert settings.needle_configs[0][0] == hidden and settings.workers == 1 and settings.plateau_max_steps > settings.max_steps
    assert settings.attention_heads >= (4 if hidden == 128 else 2)
    models = {kind: model_shapes.build_model(kind, 100, 64, settings, hidden, 0) for kind in presets.COMPARISON}
    counts = {kind: model_shapes.count_parameters(model) for kind, model in models.items()}
    layers = settings.num_hidden_layers
    for kind, count in counts.items():
        assert 0 <= counts["diff"] - count < layers * 3 * hidden + 6 * settings.head_dim * layers, kind
    assert counts["diff_no_head_norm"] == counts["diff"] - layers * 2 * settings.head_dim
    for kind in ("diff_v2", "dint_v2"):
        config = models[kind].config
        assert config.differential_attention == "v2" and not config.head_norm
        assert config.num_attention_heads == settings.attention_heads
        assert config.num_key_value_heads == settings.attention_heads // 2
        assert config.intermediate_size == model_shapes.v2_intermediate_size(settings, hidden) > settings.mlp_ratio * hidden
        assert model_shapes.v2_attention_parameters(settings, hidden) * layers == sum(
            p.numel() for layer in models[kind].model.layers for p in layer.self_attn.parameters())
    assert models["diff_v2"].config.integral == "none" and models["dint_v2"].config.integral == "mean"
    assert not models["dint_no_head_norm"].config.head_norm and models["dint"].config.head_norm


@pytest.mark.parametrize("kind", ["diff_no_head_norm", "dint_no_head_norm", "diff_v2", "dint_v2"])
def test_comparison_kinds_train_a_step_and_are_analysed(kind):
    """Each new kind trains (its loss falls over a few steps on one batch) and runs the whole job (evaluation and the
    attention analysis: DINT's final maps' rows sum to 1, V2's included)."""
    settings = presets.quick_settings()
    settings.min_steps, settings.max_steps = 2, 2
    job = dict(phase="main", task="needle", kind=kind, hidden=16, context=32, lr=2e-3, seed=0)
    record = runner.run_job(job, dataclasses.asdict(settings))
    assert record["steps"] == 2 and math.isfinite(record["answer_share"])
    if kind.startswith("dint"):  # DINT's final rows sum to 1 (DIFF's to 1 - lambda)
        assert record["max_row_sum_error"] < 1e-4
    vocab = tasks.NeedleVocabulary(settings.key_vocab, settings.value_vocab, settings.filler_vocab)
    model = model_shapes.build_model(kind, vocab.size, 64, settings, 16, 0)
    step, _ = training.make_training_step(model, 3e-3, settings)
    batch = tasks.make_mixed_needle_batch(torch.Generator().manual_seed(0), 8, 32, (2,), vocab)
    losses = [step(batch).item() for _ in range(5)]
    assert losses[-1] < losses[0]


def test_plateau_extension_applies_to_every_run_on_the_plateau():
    """Issue 38's rule: with `plateau_max_steps`, a run still on the plateau at the cap goes on to that cap, one that
    has left it stops at the cap as before; without it (the committed report's rule) nothing changes."""
    settings = presets.Settings(min_steps=200, max_steps=1000, plateau_max_steps=2000)
    steps = list(range(50, 1001, 50))
    assert not training.converged(steps, [2.1] * len(steps), 200, 1000, settings, plateau=2.5)
    assert training.converged(steps + [2000], [2.1] * (len(steps) + 1), 200, 1000, settings, plateau=2.5)
    falling = [2.1] * (len(steps) - 1) + [1.0]
    assert training.converged(steps, falling, 200, 1000, settings, plateau=2.5)  # left it by the cap: stops there
    # on the plateau at the cap, left it at 1200 and still improving at 1300: the ordinary rule decides, not the cap
    late = steps + [1050, 1100, 1150, 1200, 1250, 1300]
    late_losses = [2.1] * (len(steps) + 3) + [1.0, 0.5, 0.25]
    assert not training.converged(late, late_losses, 200, 1000, settings, plateau=2.5)
    flat = late + list(range(1350, 1701, 50))
    assert training.converged(flat, late_losses + [0.25] * 8, 200, 1000, settings, plateau=2.5)
    assert training.converged(steps, [2.1] * len(steps), 200, 1000, settings)  # no plateau: the cap
    assert training.extended_cap(1000, settings, 2.5, 200) == 2000
    assert training.extended_cap(1000, settings, 2.5, 1000) == 1000  # a fixed-length run (pilot, long) is not extended
    assert training.extended_cap(1000, presets.Settings(), 2.5, 200) == 1000


def test_plateau_retry_replaces_only_runs_left_on_the_plateau():
    """Issue 38's second rule: a registered run still on the plateau is retried on its seed at half its rate, in the
    order of the kinds given, every architecture alike; the retry stands for the seed in the summary, a run that
    learned is never retried or replaced."""
    import compare

    settings = presets.comparison_settings(64)
    plateau = tasks.plateau_loss(settings)
    stuck, left = plateau, 0.1 * plateau

    def record(phase, kind, seed, lr, loss):
        job = dict(phase=phase, task="needle", kind=kind, hidden=64, context=64, lr=lr, seed=seed)
        return {**job, "id": runner.job_id(job), "best_validation_loss": loss}

    records = [record("main", "dint", 0, 1e-3, stuck), record("main", "transformer", 3, 2e-3, stuck),
               record("main", "transformer", 0, 2e-3, left), record("main", "dint", 1, 1e-3, left)]
    records = {r["id"]: r for r in records}
    retries = compare.retry_jobs(records, settings, ["transformer", "dint"])
    assert [(job["kind"], job["seed"], job["lr"]) for job in retries] == [("transformer", 3, 1e-3), ("dint", 0, 5e-4)]
    assert compare.retry_jobs(records, presets.Settings(), ["transformer", "dint"]) == []  # no rule: no retry
    assert [r["retried"] for r in compare.seed_records(records, settings, "transformer")] == [False, False]
    retry = record("retry", "transformer", 3, 1e-3, left)
    records[retry["id"]] = retry
    chosen = compare.seed_records(records, settings, "transformer")
    assert [(r["seed"], r["retried"], r["lr"]) for r in chosen] == [(0, False, 2e-3), (3, True, 1e-3)]


@pytest.mark.parametrize("preset", ["Settings", "gpu_settings"])
def test_preset_fits_its_data(preset):
    """Every trained length holds the largest needle count with all its queries, and the corpus holds the
    language-modelling validation and test tokens the preset asks for; `--dry-run` keeps the sizes and cuts the steps."""
    settings = getattr(presets, preset)()
    vocab = tasks.NeedleVocabulary(settings.key_vocab, settings.value_vocab, settings.filler_vocab)
    for _, context in settings.needle_configs:
        count = max(settings.needle_counts + settings.train_needle_counts)
        assert tasks.make_needle_batch(torch.Generator().manual_seed(0), 2, context, count, vocab)["answers"].numel() == 2 * count
    corpus = tasks.load_corpus(settings)
    assert len(corpus["validation"]) == settings.lm_validation_tokens + 1
    assert len(corpus["test"]) >= settings.lm_test_tokens // settings.lm_context * settings.lm_context
    dry = getattr(presets, preset)()
    presets.shrink_for_dry_run(dry)
    assert (dry.needle_configs, dry.seeds, dry.device) == (settings.needle_configs, settings.seeds, settings.device)
    assert max(dry.max_steps, dry.lm_max_steps, dry.long_steps, dry.pilot_steps, dry.test_examples) <= 8


def test_convergence_rule_on_a_synthetic_curve():
    settings = presets.Settings(min_steps=200, max_steps=5000, window_fraction=0.2, min_relative_improvement=0.01,
                                min_absolute_improvement=0.0)

    def stop_step(curve, plateau=None, every=50):
        steps, losses = [], []
        for step in range(every, 100_000, every):
            steps.append(step)
            losses.append(curve(step))
            if training.converged(steps, losses, settings.min_steps, settings.max_steps, settings, plateau):
                return step
        raise AssertionError("never stopped")

    # falls until step 1000, flat after: the last 20% of steps show no 1% gain from step 1250 on
    assert stop_step(lambda s: 1.0 + max(0, 1000 - s) / 100) == 1250
    # flat from the start: stops at the first check at or after min_steps
    assert stop_step(lambda s: 1.0) == 200
    # keeps improving 10% per check: runs to the cap
    assert stop_step(lambda s: 0.9 ** (s / 50)) == 5000
    # a plateau, then a late drop: the rule (like any rule of this kind) stops on the plateau
    assert stop_step(lambda s: 2.0 if s < 3000 else 0.1) == 200

    # a needle run is not stopped on the task's own plateau (the loss of retrieval without key matching), only at
    # the cap; once below plateau_fraction of it, the rule applies as before
    assert stop_step(lambda s: 2.5 if s < 3000 else 0.1, plateau=2.5) == 3750  # left the plateau at 3000: stops later
    assert stop_step(lambda s: 2.1, plateau=2.5) == 5000  # never left it: the cap
    assert stop_step(lambda s: 1.9, plateau=2.5) == 200  # below 0.8 x 2.5 from the start: as without a plateau


def test_bootstrap_interval_and_decision_rule():
    settings = presets.Settings(bootstrap_resamples=20_000)
    mean, low, high = decision_rule.bootstrap_ci([0.5] * 5, settings)
    assert mean == low == high == 0.5
    values = np.arange(100, dtype=float)  # mean 49.5, standard error 2.90: normal 95% interval +-5.7
    mean, low, high = decision_rule.bootstrap_ci(values, settings)
    assert mean == 49.5 and abs((mean - low) - 5.7) < 0.6 and abs((high - mean) - 5.7) < 0.6
    assert decision_rule.bootstrap_ci(values, settings) == (mean, low, high)  # fixed rng: reproducible
    b = [0.2, 0.4, 0.5, 0.7, 0.9]
    assert decision_rule.beats([x + 0.1 for x in b], b, settings)[0] == "yes"
    assert decision_rule.beats([x - 0.1 for x in b], b, settings)[0] == "reversed"
    assert decision_rule.beats([x - 0.1 for x in b], b, settings, higher_is_better=False)[0] == "yes"
    verdict, (mean, low, high) = decision_rule.beats([0.3, 0.3, 0.6, 0.6, 0.9], b, settings)
    assert verdict == "no difference" and low < 0 < high


def test_a_job_is_deterministic():
    settings = presets.quick_settings()
    settings.min_steps, settings.max_steps = 4, 6
    job = dict(phase="main", task="needle", kind="dint", hidden=16, context=32, lr=2e-3, seed=0)
    first = runner.run_job(job, dataclasses.asdict(settings))
    torch.manual_seed(123)  # global state must not matter
    second = runner.run_job(job, dataclasses.asdict(settings))
    for key in ("validation_losses", "accuracy", "first_query_accuracy", "answer_share", "steps", "best_step"):
        assert first[key] == second[key]
    assert first["steps"] == 6 and first["hit_cap"]


@pytest.mark.parametrize("layout", ["pairs_first", "haystack"])
def test_attention_statistics_partition_the_answer_query_row(layout):
    """The answer query's last-layer row is split into the queried needle, the other needles (per needle), the filler
    and the queries; the previous-token score is a first-layer value -> key attention weight."""
    settings = presets.quick_settings()
    vocab = tasks.NeedleVocabulary(settings.key_vocab, settings.value_vocab, settings.filler_vocab)
    needles, width = 4, {"pairs_first": 2, "haystack": 3}[layout]
    batch = tasks.make_needle_batch(torch.Generator().manual_seed(3), 6, 48, needles, vocab, layout=layout)
    answers = torch.arange(6 * needles)
    queries = ~batch["filler"] & ~batch["needles"]  # the query keys (and the haystack's QUERY markers)
    for kind in ("transformer", "dint"):
        model = model_shapes.build_model(kind, vocab.size, 48, settings, 32, 0)
        statistics, _ = evaluation.attention_statistics(model, kind, batch)
        model.set_attn_implementation("eager")
        attentions = model(input_ids=batch["input_ids"], output_attentions=True).attentions
        final_maps = model_shapes.final_attention_maps(model, kind, attentions)
        rows = final_maps[-1].mean(1)[batch["answer_rows"], batch["answer_columns"]]  # [R, T]
        query_section = (rows * queries[batch["answer_rows"]]).sum(-1).mean().item()
        total = (statistics["answer_share"] + statistics["filler_share"] + query_section
                 + (needles - 1) * statistics["other_needle_share"])
        assert total == pytest.approx(1.0, abs=1e-5)
        queried = rows[answers[:, None], batch["needle_start"][:, None] + torch.arange(width)].sum(-1)
        assert statistics["answer_share"] == pytest.approx(queried.mean().item(), abs=1e-6)
        value_position = batch["needle_start"] + width - 1
        per_head = final_maps[0][batch["answer_rows"], :, value_position, value_position - 1].mean(0)
        assert statistics["previous_token_score"] == pytest.approx(per_head.max().item(), abs=1e-6)


@pytest.mark.slow
def test_compiled_training_step_matches_eager():
    """The compiled training step (forward and backward by torch.compile) makes the same losses as the eager one on
    the same model and batches, and its job is deterministic like the eager one."""
    settings = presets.quick_settings()
    vocab = tasks.NeedleVocabulary(settings.key_vocab, settings.value_vocab, settings.filler_vocab)
    histories = {}
    for compiled in (False, True):
        settings.compile = compiled
        model = model_shapes.build_model("dint", vocab.size, 64, settings, 16, 0)
        generator = torch.Generator().manual_seed(0)
        validation = tasks.make_mixed_needle_batch(torch.Generator().manual_seed(1), 12, 32, (1, 2, 4), vocab)
        histories[compiled] = training.train_to_convergence(
            model, lambda: tasks.make_mixed_needle_batch(generator, 12, 32, (1, 2, 4), vocab), validation, 3e-3,
            20, 20, 5, settings,
        )
    assert histories[True]["validation_losses"] == pytest.approx(histories[False]["validation_losses"], rel=1e-4)
    job = dict(phase="main", task="needle", kind="transformer", hidden=16, context=32, lr=2e-3, seed=0)
    settings.min_steps, settings.max_steps = 4, 6
    first, second = (runner.run_job(job, dataclasses.asdict(settings)) for _ in range(2))
    assert first["validation_losses"] == second["validation_losses"] and first["accuracy"] == second["accuracy"]


@pytest.mark.slow
def test_quick_run_writes_complete_report(tmp_path):
    out = run.main(["--quick", "--out", str(tmp_path)])
    report = (out / "report.md").read_text()
    for section in ("## Rules fixed before the run", "## Setup", "## Learning-rate sweep", "## Convergence",
                    "## Multi-needle retrieval", "### The first query of each example", "## Length generalisation",
                    "## Model size", "## Attention analysis",
                    "## Ablations", "## Language modelling", "## Claims, one by one", "## Was the task learned?",
                    "## What changed from the earlier runs", "## Why this may differ"):
        assert section in report
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report):
        assert (out / image).stat().st_size > 1000
    assert {"accuracy_vs_length.png", "attention_maps.png", "convergence.png"} <= {p.name for p in out.glob("*.png")}
    assert "nan" not in report.lower() and "inf " not in report.lower()

    results = json.loads((out / "results.json").read_text())

    def numbers(value):
        if isinstance(value, dict):
            for v in value.values():
                yield from numbers(v)
        elif isinstance(value, list):
            for v in value:
                yield from numbers(v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield value

    assert all(math.isfinite(x) for x in numbers(results))
    settings = results["settings"]
    seeds = settings["seeds"]
    assert len(seeds) >= 3
    runs = results["runs"]
    for hidden, context in settings["needle_configs"]:
        for kind in ("transformer", "diff", "dint"):
            records = [r for r in runs if (r["task"], r["kind"], r["hidden"], r["context"]) == ("needle", kind, hidden, context)
                       and r["phase"] != "long"]
            assert sorted(r["seed"] for r in records) == sorted(seeds)
            for record in records:
                for field in ("accuracy", "first_query_accuracy"):
                    assert set(record[field]) == {str(f) for f in settings["length_factors"]}
                    assert all(0 <= a <= 1 for by_count in record[field].values() for a in by_count.values())
                assert 0 < record["steps"] <= settings["max_steps"]
    for kind in settings["ablations"]:
        assert len([r for r in runs if r["kind"] == kind]) == len(seeds)
    lm = [r for r in runs if r["task"] == "lm"]
    assert len(lm) == 3 * len(settings["lm_seeds"]) and all(r["test_perplexity"] > 1 for r in lm)
    # every swept (task, architecture, size) got a learning rate from the sweep's values
    assert all(lr in settings["learning_rates"] + settings["lm_learning_rates"] for lr in results["learning_rates"].values())
    # what the formulas guarantee: softmax and DINT rows sum to 1 with no negative Transformer entries, DIFF rows don't
    needle = [r for r in runs if r["task"] == "needle"]
    for record in needle:
        if record["kind"] in ("dint", "transformer"):
            assert record["max_row_sum_error"] < 1e-4
        if record["kind"] == "diff":
            assert record["max_row_sum_error"] > 1e-2
        if record["kind"] == "transformer":
            assert record["negative_fraction"] == 0
    assert results["claims"]
    # the report is a pure function of results.json: --report-only rewrites it identically
    run.main(["--quick", "--out", str(tmp_path), "--report-only"])
    assert (out / "report.md").read_text() == report


@pytest.mark.slow
def test_quick_pilot_writes_its_curve(tmp_path):
    """`--pilot`: each architecture trained exactly `pilot_steps` steps, its validation accuracy per needle count over
    every query and over the first query at every evaluation, in pilot.json, pilot.md and pilot.png; `--report-only`
    rewrites pilot.md identically from pilot.json."""
    out = run.main(["--quick", "--pilot", "--out", str(tmp_path)])
    pilot = json.loads((out / "pilot.json").read_text())
    settings = pilot["settings"]
    assert [r["kind"] for r in pilot["runs"]] == list(settings["pilot_kinds"])
    for record in pilot["runs"]:
        assert record["steps"] == settings["pilot_steps"] and record["phase"] == "pilot"
        assert record["eval_steps"] == list(range(settings["pilot_eval_every"], settings["pilot_steps"] + 1,
                                                  settings["pilot_eval_every"]))
        for accuracies in record["validation_accuracy"]:
            assert set(accuracies) == {"all", "first"}
            assert set(accuracies["all"]) == {str(n) for n in settings["train_needle_counts"]}
    text = (out / "pilot.md").read_text()
    assert "| transformer, lr" in text and (out / "pilot.png").stat().st_size > 0
    assert not (out / "pilot_jobs.jsonl").exists()
    run.main(["--quick", "--pilot", "--out", str(tmp_path), "--report-only"])
    assert (out / "pilot.md").read_text() == text


@pytest.mark.slow
def test_long_pilot_writes_one_pilot_record(tmp_path):
    """`long_pilot.py` runs one pilot job of the default preset for the steps asked and writes its record."""
    import subprocess

    out = tmp_path / "record.json"
    subprocess.run([sys.executable, str(RESEARCH_DIR / "long_pilot.py"), "dint", "--lr", "2e-3", "--steps", "4",
                    "--eval-every", "2", "--seed", "7", "--out", str(out)], check=True, cwd=REPO_ROOT)
    record = json.loads(out.read_text())
    assert (record["kind"], record["phase"], record["seed"], record["steps"]) == ("dint", "pilot", 7, 4)
    assert record["eval_steps"] == [2, 4] and len(record["validation_accuracy"]) == 2
    assert record["command"].startswith("python research/long_pilot.py dint")


def test_language_modelling_comparison_runs_to_its_summary(tmp_path, capsys):
    """`compare.py --task lm` (issue 38 item 4), shrunk to 2 steps a run: the sweep chooses a swept rate per
    architecture, every registered run has a test perplexity, the summary gives the runs and a verdict on test
    perplexity; run again, it resumes from its journal without training."""
    import compare

    arguments = ["--task", "lm", "--dry-run", "--no-compile", "--workers", "1", "--seeds", "0", "1",
                 "--kinds", "transformer", "dint_v2", "--out", str(tmp_path)]
    compare.main(arguments)
    records = [json.loads(line) for line in (tmp_path / "jobs.jsonl").read_text().splitlines()]
    settings = presets.comparison_settings(64)
    assert sorted(r["id"] for r in records if r["phase"] == "sweep") == sorted(
        runner.job_id(job) for job in compare.lm_sweep_jobs(settings, ["transformer", "dint_v2"]))
    main_runs = [r for r in records if r["phase"] == "main"]
    assert sorted((r["kind"], r["seed"]) for r in main_runs) == [("dint_v2", 0), ("dint_v2", 1), ("transformer", 0),
                                                                  ("transformer", 1)]
    assert all(r["task"] == "lm" and math.isfinite(r["test_perplexity"]) for r in main_runs)
    assert {r["device"] for r in records} == {"cpu"}
    chosen = json.loads((tmp_path / "learning_rates.json").read_text())
    assert set(chosen) == {"transformer", "dint_v2"} and set(chosen.values()) <= set(settings.lm_learning_rates)
    assert all(r["lr"] == chosen[r["kind"]] for r in main_runs)
    summary = (tmp_path / "summary.md").read_text()
    assert "| transformer |" in summary and "DINT-V2" in summary
    assert "- dint_v2 beats transformer (lower test perplexity)? " in summary
    import report_v2  # the report's language-modelling section from this journal (2 of 5 seeds: pending verdicts)

    (tmp_path / "results" / "lm_h64").mkdir(parents=True)
    (tmp_path / "results" / "lm_h64" / "jobs.jsonl").write_text((tmp_path / "jobs.jsonl").read_text())
    report = report_v2.write_report(tmp_path, results=tmp_path / "results").split("## Claim 6")[1]
    assert f"| {report_v2.name('transformer')} | {chosen['transformer']} | 2 | " in report
    assert f"| {report_v2.name('dint_v2')} vs {report_v2.name('transformer')} | pending (seeds run 2 and 2) |" in report
    capsys.readouterr()
    compare.main(arguments)  # resumes: every job is in the journal
    assert len((tmp_path / "jobs.jsonl").read_text().splitlines()) == len(records)
    assert "jobs to run" not in capsys.readouterr().out


def test_long_diagnostic_runs_exactly_its_steps_into_its_own_journal(tmp_path, capsys):
    """`compare.py --long LR STEPS` (a diagnostic beyond the registered budget): each kind on each seed at LR for
    exactly STEPS steps, fully evaluated, in `long_STEPS/jobs.jsonl`, never the comparison's journal; --long with
    options it does not take, or steps that are not a whole number, is a clear error."""
    import compare

    compare.main(["--hidden", "128", "--kinds", "diff_v2", "--seeds", "3", "--long", "2e-3", "1", "--dry-run",
                  "--no-compile", "--workers", "1", "--out", str(tmp_path)])
    (record,) = [json.loads(line) for line in (tmp_path / "long_1" / "jobs.jsonl").read_text().splitlines()]
    assert (record["phase"], record["kind"], record["seed"], record["lr"], record["steps"]) == ("long", "diff_v2", 3,
                                                                                               2e-3, 1)
    assert record["device"] == "cpu" and "accuracy" in record and not (tmp_path / "jobs.jsonl").exists()
    for wrong in (["--long", "2e-3", "1.2e4"], ["--long", "2e-3", "10", "--summary-only"], ["--long", "0", "10"]):
        with pytest.raises(SystemExit):
            compare.main(["--hidden", "128", "--out", str(tmp_path), *wrong])
    assert "--long" in capsys.readouterr().err


def test_a_journal_takes_runs_of_one_device(tmp_path, capsys):
    import compare

    (tmp_path / "jobs.jsonl").write_text(json.dumps({"id": "main/needle/dint/h64/T64/lr0.001/s0",
                                                      "device": "NVIDIA H100 80GB HBM3"}) + "\n")
    with pytest.raises(SystemExit):
        compare.main(["--hidden", "64", "--out", str(tmp_path), "--seeds", "0"])
    assert "holds runs on NVIDIA H100 80GB HBM3, not cpu" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where no CUDA device exists")
def test_device_cuda_without_a_gpu_is_a_clear_error(tmp_path, capsys):
    import compare

    with pytest.raises(SystemExit):
        compare.main(["--hidden", "128", "--device", "cuda", "--out", str(tmp_path)])
    assert "--device cuda needs a CUDA GPU" in capsys.readouterr().err


def test_report_gives_the_summarys_verdicts_and_the_budget_curves(tmp_path):
    """`report_v2.py` (issue 38 item 5) from the committed journals: at hidden 64 (complete) every verdict of
    `h64/summary.md` under its claim, the pairs without a verdict named as such, and the budget curve of DIFF-V1 as the
    paper defines it (on the plateau at every seed, its retries included); every pair belongs to one claim."""
    import report_v2

    report = report_v2.write_report(tmp_path)
    assert (tmp_path / "report.md").read_text() == report
    summary = (RESEARCH_DIR / "results" / "v2" / "h64" / "summary.md").read_text()
    verdict_lines = re.findall(r"^- (\w+) beats (\w+)\? (.*)\.$", summary, flags=re.MULTILINE)
    assert len(verdict_lines) == 7
    needle_claims = report.split("## Claim 6")[0]  # the language-modelling tables name the same pairs
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1] for line in needle_claims.splitlines()
            if " vs " in line and line.startswith("| ")}
    for a, b, verdicts in verdict_lines:
        cell = rows[f"{report_v2.name(a)} vs {report_v2.name(b)}"]
        for measure in verdicts.split("; "):
            label, verdict_and_difference = measure.split(": ")
            verdict, difference = re.match(r"(yes|reversed|no difference) (.*)", verdict_and_difference).groups()
            assert f"{label}: **{verdict}** {difference}" in cell
    for a, b in (("dint", "diff"), ("diff", "transformer")):
        assert rows[f"{report_v2.name(a)} vs {report_v2.name(b)}"].startswith("no verdict (learned ")
    budget = report.split("## Budget curves")[1].split("## Claim 1")[0]
    diff_at_64 = budget.split(f"- hidden 64 (CPU), {report_v2.name('diff')}")[1].split("\n- ")[0]
    assert diff_at_64.count("main lr 0.001: ") == diff_at_64.count("retry lr 0.0005: ") == 5
