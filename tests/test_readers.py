"""Log readers: every format on a hand-written fixture in its real format, detection, errors, names.

Expected values below are copied by hand from the fixture files in tests/fixtures/logs/.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lossparity.parity import (
    FORMATS,
    LogParseError,
    canonical_name,
    detect_format,
    is_canonical,
    parse_name_map,
    read_log,
)
from lossparity.parity._record import is_number_array

LOGS = Path(__file__).parent / "fixtures" / "logs"


def assert_series(actual: dict[int, float], expected: dict[int, float]) -> None:
    assert sorted(actual) == sorted(expected)
    for step, value in expected.items():
        if math.isnan(value):
            assert math.isnan(actual[step]), step
        else:
            assert actual[step] == pytest.approx(value, rel=1e-12, abs=0.0), step


# ---------------------------------------------------------------------------------------------------
# one test per format


def test_megatron_text_restart_skipped_and_nan_iterations():
    run = read_log(LOGS / "megatron_restart.log")
    assert run.format == "megatron" and run.step_base == 1
    # iterations 3 (skipped) and 4 (NaN) print no losses: left out; 6 and 7 come from the restarted run
    assert_series(run.metrics["lm_loss"], {1: 10.8234, 2: 10.5012, 5: 9.8765, 6: 9.5431, 7: 9.301, 8: 9.1234})
    assert_series(run.metrics["mtp_1_loss"], {1: 10.8312, 2: 10.5187, 5: 9.9012, 6: 9.5803, 7: 9.3451, 8: 9.1702})
    assert_series(
        run.metrics["load_balancing_loss"], {1: 1.02134, 2: 1.01876, 5: 1.0123, 6: 1.0097, 7: 1.0076, 8: 1.0055}
    )
    assert_series(run.metrics["grad_norm"], {1: 5.432, 2: 4.987, 5: 3.21, 6: 2.988, 7: 2.766, 8: 2.543})
    assert_series(run.metrics["lr"], {1: 1.5e-5, 2: 3e-5, 3: 3e-5, 4: 3e-5, 5: 4.5e-5, 6: 6e-5, 7: 7.5e-5, 8: 9e-5})
    assert_series(run.metrics["loss_scale"], {1: 1.0, 2: 1.0, 3: 0.5, 4: 0.5, 5: 0.5, 6: 0.5, 7: 0.5, 8: 0.5})
    assert run.consumed_samples == {s: 8.0 * s for s in range(1, 9)}
    assert run.skipped_steps == {3, 4}
    assert run.restarts == 1
    # the first run's iterations 6 and 7 had 9 numeric fields each besides consumed samples
    assert run.dropped_values == 18
    # 30 lines, 10 of them iteration lines (the validation line is not an iteration line)
    assert run.skipped_lines == 20
    assert run.raw_names["lm_loss"] == "lm loss" and run.raw_names["mtp_1_loss"] == "mtp_1 loss"


def test_restart_discards_the_abandoned_trajectory(tmp_path):
    def line(it: int, loss: float) -> str:
        return (
            f" [2026-03-01 10:00:00] iteration {it:8d}/{20:8d} | consumed samples: {4 * it:12d} | "
            f"lm loss: {loss:.6E} | loss scale: 1.0 | number of skipped iterations:   0 | "
            "number of nan iterations:   0 |"
        )

    first = [line(i, 10.0 - i) for i in range(1, 9)]  # run A reaches iteration 8
    second = [line(i, 20.0 - i) for i in range(5, 7)]  # run B restarts from 4 and stops at 6
    log = tmp_path / "restart.log"
    log.write_text("\n".join([*first, "restarting", *second]) + "\n")
    run = read_log(log, fmt="megatron")
    # A's 7 and 8 belong to the abandoned trajectory: dropped although B never reached them
    assert_series(run.metrics["lm_loss"], {1: 9.0, 2: 8.0, 3: 7.0, 4: 6.0, 5: 15.0, 6: 14.0})
    assert sorted(run.consumed_samples) == [1, 2, 3, 4, 5, 6]
    assert run.restarts == 1 and run.dropped_values == 2 * 4  # lm loss + loss scale at A's 5..8


def _write_events(directory: Path, name: str, events: list[tuple[int, dict[str, float]]]) -> None:
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    tmp = directory / f"writer_{name}"
    writer = EventFileWriter(str(tmp))
    for step, scalars in events:
        values = [summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in scalars.items()]
        writer.add_event(event_pb2.Event(step=step, wall_time=1.0e9 + step, summary=summary_pb2.Summary(value=values)))
    writer.close()
    (produced,) = list(tmp.iterdir())
    directory.mkdir(parents=True, exist_ok=True)
    produced.rename(directory / name)
    tmp.rmdir()


def test_tensorboard_megatron_tags_restart_and_samples(tmp_path):
    pytest.importorskip("tensorboard")
    tb = tmp_path / "tb"

    def ev(step: int, loss: float) -> tuple[int, dict[str, float]]:
        return step, {"lm loss": loss, "grad-norm": 0.25 * step, "mtp_1 loss": loss + 0.5}

    run1 = [ev(s, 10.0 - 0.5 * s) for s in range(1, 7)]
    run1 += [(8 * s, {"lm loss vs samples": 10.0 - 0.5 * s}) for s in range(1, 7)]
    run2 = [ev(s, 20.0 - 0.5 * s) for s in range(5, 8)]
    run2 += [(8 * s, {"lm loss vs samples": 20.0 - 0.5 * s}) for s in range(5, 8)]
    # file names carry the creation time; the restarted job's file is the later one
    _write_events(tb, "events.out.tfevents.1700000000.node0.11.0", run1)
    _write_events(tb, "events.out.tfevents.1700000500.node0.12.0", run2)

    assert detect_format(tb) == "tensorboard"
    run = read_log(tb)
    assert run.format == "tensorboard" and run.step_base == 1
    assert_series(run.metrics["lm_loss"], {1: 9.5, 2: 9.0, 3: 8.5, 4: 8.0, 5: 17.5, 6: 17.0, 7: 16.5})
    assert_series(run.metrics["mtp_1_loss"], {1: 10.0, 2: 9.5, 3: 9.0, 4: 8.5, 5: 18.0, 6: 17.5, 7: 17.0})
    assert_series(run.metrics["grad_norm"], {s: 0.25 * s for s in range(1, 8)})  # float32-exact values
    assert "lm loss vs samples" not in run.metrics
    assert run.consumed_samples == {s: 8.0 * s for s in range(1, 8)}


def test_tensorboard_maxtext_tags_and_tensor_summaries(tmp_path):
    pytest.importorskip("tensorboard")
    import numpy as np
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    from tensorboard.util import tensor_util

    out = tmp_path / "maxtext_tb" / "moe-parity"
    writer = EventFileWriter(str(out))
    scalars_plugin = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
    )
    for step in range(3):
        values = [
            summary_pb2.Summary.Value(tag="learning/loss", simple_value=11.0 - step),
            summary_pb2.Summary.Value(tag="learning/moe_lb_loss", simple_value=0.25),
            summary_pb2.Summary.Value(tag="learning/total_weights", simple_value=4096.0 + step),
            # TF2-style tensor summary, as jax/flax writers produce
            summary_pb2.Summary.Value(
                tag="learning/lm_loss",
                metadata=scalars_plugin,
                tensor=tensor_util.make_tensor_proto(np.float32(10.5 - step)),
            ),
        ]
        writer.add_event(event_pb2.Event(step=step, wall_time=1.0e9 + step, summary=summary_pb2.Summary(value=values)))
    writer.close()

    run = read_log(tmp_path / "maxtext_tb")  # searched recursively
    assert run.step_base == 0  # MaxText counts steps from 0
    assert_series(run.metrics["objective"], {0: 11.0, 1: 10.0, 2: 9.0})
    assert_series(run.metrics["lm_loss"], {0: 10.5, 1: 9.5, 2: 8.5})
    assert_series(run.metrics["load_balancing_loss"], {0: 0.25, 1: 0.25, 2: 0.25})
    assert_series(run.metrics["tokens"], {0: 4096.0, 1: 4097.0, 2: 4098.0})


def test_jsonl_lossparity_log():
    run = read_log(LOGS / "lossparity.jsonl")
    assert run.format == "jsonl" and run.step_base == 1
    # null = missing (left out); "nan" and NaN are recorded as NaN
    assert_series(run.metrics["lm_loss"], {1: 10.8234, 2: 10.5012, 4: math.nan})
    assert_series(run.metrics["objective"], {1: 10.8401, 2: 10.5187, 3: 0.0, 4: math.nan})
    assert_series(run.metrics["tokens"], {1: 32640.0, 2: 32512.0, 3: 0.0, 4: 32500.0})
    assert_series(run.metrics["mtp_1_loss"], {1: 10.8312, 2: 10.5187})
    assert_series(run.metrics["lr"], {1: 1.5e-5, 2: 3e-5, 3: 3e-5, 4: 4.5e-5})
    assert run.consumed_samples == {1: 8.0, 2: 16.0, 3: 24.0, 4: 32.0}
    assert "consumed_samples" not in run.metrics
    assert run.skipped_lines == 1  # the blank line


def test_jsonl_maxtext_metrics_file():
    run = read_log(LOGS / "maxtext_metrics.jsonl")
    assert run.format == "jsonl" and run.step_base == 0
    assert_series(run.metrics["objective"], {0: 10.8693265914917, 1: 10.5521})
    assert_series(run.metrics["lm_loss"], {0: 10.8512, 1: 10.5342})
    assert_series(run.metrics["load_balancing_loss"], {0: 0.0123, 1: 0.0121})
    # raw_grad_norm is the pre-clip norm = canonical grad_norm; grad_norm is post-clip
    assert_series(run.metrics["grad_norm"], {0: 5.087409973144531, 1: 4.6})
    assert_series(run.metrics["clipped_grad_norm"], {0: 1.0000004768371582, 1: 0.9999998807907104})
    assert_series(run.metrics["tokens"], {0: 79694.0, 1: 79701.0})
    assert_series(run.metrics["lr"], {0: 2.9999999242136255e-05, 1: 5.999999848427251e-05})
    assert "run_name" not in run.metrics


def test_jsonl_long_form(tmp_path):
    log = tmp_path / "long.jsonl"
    log.write_text(
        '{"step": 1, "metric": "lm loss", "value": 2.5}\n{"step": 1, "metric": "grad norm", "value": 0.75}\n'
        '{"step": 2, "metric": "lm loss", "value": 2.25}\n{"step": 2, "metric": "grad norm", "value": null}\n'
    )
    run = read_log(log)
    assert_series(run.metrics["lm_loss"], {1: 2.5, 2: 2.25})
    assert_series(run.metrics["grad_norm"], {1: 0.75})


def test_jsonl_long_form_series_one_after_another(tmp_path):
    lines = [{"step": s, "metric": "lm_loss", "value": 3.0 - 0.1 * s} for s in (1, 2, 3)]
    lines += [{"step": s, "metric": "grad_norm", "value": 1.0 * s} for s in (1, 2, 3)]
    # lm_loss written again at its last step: replaced; grad_norm going back to 2: a restart of grad_norm only
    lines += [
        {"step": 3, "metric": "lm_loss", "value": 9.0},
        {"step": 2, "metric": "grad_norm", "value": 7.0},
        {"step": 2, "metric": "consumed_samples", "value": 8},
    ]
    log = tmp_path / "series.jsonl"
    log.write_text("".join(json.dumps(obj) + "\n" for obj in lines))
    run = read_log(log)
    assert_series(run.metrics["lm_loss"], {1: 2.9, 2: 2.8, 3: 9.0})
    assert_series(run.metrics["grad_norm"], {1: 1.0, 2: 7.0})
    assert run.consumed_samples == {2: 8.0}
    assert run.restarts == 1 and run.dropped_values == 2


def test_csv_wandb_export():
    run = read_log(LOGS / "wandb_export.csv")
    assert run.format == "csv"
    assert set(run.metrics) == {"objective", "grad_norm", "lr", "train/epoch"}  # __MIN/__MAX ignored
    assert_series(run.metrics["objective"], {10: 2.4567, 20: 2.3012, 40: math.nan})  # empty cell = missing
    assert_series(run.metrics["grad_norm"], {10: 3.2108, 30: 2.5432, 40: 2.4001})
    assert_series(run.metrics["lr"], {10: 4.9e-5, 20: 4.7e-5, 30: 4.5e-5, 40: 4.3e-5})


def test_megatron_golden_values():
    run = read_log(LOGS / "golden_values.json")
    assert run.format == "megatron_golden"
    assert_series(run.metrics["lm_loss"], {1: 10.84781, 2: 10.85463, 3: 10.84622, 4: 10.81205, 5: 10.75634})
    assert_series(run.metrics["mtp_1_loss"], {1: 10.86012, 3: 10.85109, 5: 10.77777})
    # the string "nan" is Megatron's marker of a step the run did not log: missing, not a NaN value
    assert_series(run.metrics["num_zeros"], {1: 1123.0, 3: 1098.0, 4: 1120.0, 5: 1101.0})
    assert_series(run.metrics["iteration-time"], {2: 0.53124, 3: 0.52011, 4: 0.52203, 5: 0.51987})
    assert any("2 value(s)" in n and "missing" in n for n in run.notes)


def test_megatron_golden_values_list_form(tmp_path):
    log = tmp_path / "golden_list.json"
    log.write_text('{"lm loss": {"start_step": 0, "end_step": 15, "step_interval": 5, "values": [3.0, 2.5, "nan"]}}')
    run = read_log(log)
    # Megatron's legacy script kept TensorBoard events 0, 5, 10 (event 0 = iteration 1); "nan" = not logged
    assert_series(run.metrics["lm_loss"], {1: 3.0, 6: 2.5})


def test_hf_trainer_state():
    run = read_log(LOGS / "trainer_state.json")
    assert run.format == "hf_trainer_state" and run.step_base == 1
    assert_series(run.metrics["objective"], {10: 2.4567, 20: 2.3012, 30: 2.2109})
    assert_series(run.metrics["grad_norm"], {10: 3.2108, 20: 2.8765, 30: 2.5432})
    assert_series(run.metrics["lr"], {10: 4.9e-5, 20: 4.7e-5, 30: 4.5e-5})
    assert_series(run.metrics["eval_loss"], {20: 2.2891})
    # the end-of-training summary entry (train_loss, train_runtime) is not a step's value
    assert "train_loss" not in run.metrics
    assert any("summary" in n for n in run.notes)
    assert run.restarts == 0


def test_maxtext_console():
    run = read_log(LOGS / "maxtext_console.log")
    assert run.format == "maxtext" and run.step_base == 0
    assert_series(run.metrics["objective"], {0: 10.876, 1: 10.832, 2: 10.514})
    assert_series(run.metrics["lm_loss"], {1: 10.817, 2: 10.499})  # older lines have no lm_loss
    assert_series(run.metrics["tokens"], {0: 65536.0, 1: 65530.0, 2: 65519.0})
    assert_series(run.metrics["load_balancing_loss"], {1: 0.015, 2: 0.015})
    assert_series(run.metrics["Tokens/s/device"], {0: 663.52, 1: 16001.234, 2: 16007.821})
    assert run.skipped_lines == 5


def test_torchtitan_console_with_ansi_codes():
    run = read_log(LOGS / "torchtitan.log")
    assert run.format == "torchtitan" and run.step_base == 1
    assert_series(run.metrics["objective"], {1: 12.2345, 2: 11.8765, 3: 11.5012})  # not the validate line
    assert_series(run.metrics["grad_norm"], {1: 4.5678, 2: 3.9012, 3: 3.4567})
    assert_series(run.metrics["tps"], {1: 1234.0, 2: 12345.0, 3: 12401.0})
    assert_series(run.metrics["memory"], {1: 18.42, 2: 20.11, 3: 20.11})
    assert_series(run.metrics["mfu"], {1: 7.22, 2: 72.25, 3: 72.58})
    assert run.skipped_lines == 5


def test_mindformers_epochs_and_overflow():
    run = read_log(LOGS / "mindformers.log")
    assert run.format == "mindformers"
    # step within epoch -> global: (epoch - 1) * 3 + step
    assert_series(run.metrics["objective"], {1: 10.873456, 2: 10.512345, 3: 10.498765, 4: 10.301234})
    assert_series(run.metrics["grad_norm"], {1: 4.567891, 2: 4.123456, 3: math.inf, 4: 3.876543})
    assert_series(run.metrics["lr"], {1: 1e-5, 2: 2e-5, 3: 3e-5, 4: 4e-5})
    assert_series(run.metrics["per_step_time"], {1: 5123.0, 2: 878.0, 3: 899.0, 4: 900.0})
    assert run.skipped_steps == {3}
    assert run.skipped_lines == 3


# ---------------------------------------------------------------------------------------------------
# detection


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("megatron_restart.log", "megatron"),
        ("lossparity.jsonl", "jsonl"),
        ("maxtext_metrics.jsonl", "jsonl"),
        ("wandb_export.csv", "csv"),
        ("golden_values.json", "megatron_golden"),
        ("trainer_state.json", "hf_trainer_state"),
        ("maxtext_console.log", "maxtext"),
        ("torchtitan.log", "torchtitan"),
        ("mindformers.log", "mindformers"),
    ],
)
def test_detect_format(name, fmt):
    assert fmt in FORMATS
    assert detect_format(LOGS / name) == fmt


def test_detect_format_does_not_depend_on_the_file_name(tmp_path):
    for name, fmt in [
        ("trainer_state.json", "hf_trainer_state"),
        ("wandb_export.csv", "csv"),
        ("torchtitan.log", "torchtitan"),
        ("golden_values.json", "megatron_golden"),
    ]:
        copy = tmp_path / f"copy_of_{fmt}.txt"
        copy.write_bytes((LOGS / name).read_bytes())
        assert detect_format(copy) == fmt


def test_detect_format_unknown_and_missing(tmp_path):
    other = tmp_path / "notes.txt"
    other.write_text("nothing to see here\njust text\n")
    with pytest.raises(LogParseError, match="notes.txt"):
        detect_format(other)
    with pytest.raises(FileNotFoundError, match="missing.log"):
        read_log(tmp_path / "missing.log")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(LogParseError, match="tfevents"):
        detect_format(empty_dir)
    with pytest.raises(ValueError, match="unknown log format 'nope'"):
        read_log(LOGS / "torchtitan.log", fmt="nope")


def test_explicit_format_and_alias():
    assert read_log(LOGS / "trainer_state.json", fmt="hf").format == "hf_trainer_state"
    assert read_log(LOGS / "golden_values.json", fmt="golden").format == "megatron_golden"


# ---------------------------------------------------------------------------------------------------
# malformed input: file name, line number, what was expected


def test_megatron_malformed_line_names_file_and_line():
    with pytest.raises(LogParseError) as info:
        read_log(LOGS / "megatron_malformed.log")
    err = info.value
    assert err.line == 3 and err.path.endswith("megatron_malformed.log")
    assert "megatron_malformed.log:3" in str(err) and "lm loss" in str(err) and "1.05x120E+01" in str(err)


@pytest.mark.parametrize(
    ("fmt", "text", "line", "needle"),
    [
        ("megatron", "noise\n [x] iteration        2/ | lm loss: 1.0 |\n", 2, "iteration N/ M"),
        ("megatron", " iteration 1/ 5 | lm loss: 1.0 | garbage |\n", 1, "name: value"),
        ("jsonl", '{"step": 1, "lm_loss": 2.0}\n{"step": 2, "lm_loss": 1.9\n', 2, "JSON object"),
        ("jsonl", '{"step": 1, "lm_loss": 2.0}\n\n{"lm_loss": 1.9}\n', 3, "'step'"),
        ("jsonl", '{"step": 1.5, "lm_loss": 2.0}\n', 1, "integer 'step'"),
        ("csv", "step,loss\n1,2.0\n2,oops\n3,1.8\n", 3, "column 'loss'"),
        ("csv", "step,loss\n1,2.0\nx,1.9\n", 3, "integer step"),
        ("csv", "time,loss\n1,2.0\n", 1, "step column"),
        ("maxtext", "hello\ncompleted step: 1, seconds: 0.5, loss: 1.0\ncompleted step: 2, loss: abc\n", 3, "'loss'"),
        ("maxtext", "completed step: two, loss: 1.0\n", 1, "integer"),
        ("torchtitan", "x - INFO - step:  1  loss: 2.0\nx - INFO - step:  2  loss: nope  grad_norm: 1\n", 2, "'loss'"),
        ("torchtitan", "x - INFO - step:  abc  loss: 2.0\n", 1, "step: N"),
        ("mindformers", "a\nb\n{ Epoch:[  1/  2], step:[ x/ 3], loss: 1.0\n", 3, "Epoch:[e/E]"),
        ("mindformers", "{ Epoch:[  1/  2], step:[ 1/ 3], loss: 1.0, overflow cond: maybe\n", 1, "overflow cond"),
    ],
)
def test_malformed_lines(tmp_path, fmt, text, line, needle):
    log = tmp_path / f"bad_{fmt}.log"
    log.write_text(text)
    with pytest.raises(LogParseError) as info:
        read_log(log, fmt=fmt)
    assert info.value.line == line
    assert f"bad_{fmt}.log:{line}:" in str(info.value)
    assert needle in str(info.value)


def test_malformed_json_documents(tmp_path):
    golden = tmp_path / "golden.json"
    golden.write_text(
        '{"lm loss": {"start_step": 1, "end_step": 2, "step_interval": 1, "values": {"1": 2.0, "2": "x"}}}'
    )
    with pytest.raises(LogParseError, match=r"golden.json \(metric 'lm loss'\): expected a number"):
        read_log(golden, fmt="megatron_golden")
    state = tmp_path / "trainer_state.json"
    state.write_text('{"log_history": [{"step": 1, "loss": 2.0}, {"loss": 1.0}]}')
    with pytest.raises(LogParseError, match=r"log_history\[1\]"):
        read_log(state)
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "log_history": [\n    {"step": 1,, "loss": 2.0}\n  ]\n}\n')
    with pytest.raises(LogParseError) as info:
        read_log(broken, fmt="hf_trainer_state")
    assert info.value.line == 3


# ---------------------------------------------------------------------------------------------------
# names


def test_canonical_names_across_frameworks():
    table = {
        "lm loss": "lm_loss",
        "learning/lm_loss": "lm_loss",
        "lm_loss": "lm_loss",
        "mtp_1 loss": "mtp_1_loss",
        "mtp_2_loss": "mtp_2_loss",
        "mtp_1_loss": "mtp_1_loss",
        "learning/loss": "objective",
        "loss": "objective",
        "train/loss": "objective",
        "loss_metrics/global_avg_loss": "objective",
        "load_balancing_loss": "load_balancing_loss",
        "learning/moe_lb_loss": "load_balancing_loss",
        "seq_load_balancing_loss": "seq_load_balancing_loss",
        "z_loss": "z_loss",
        "learning/z_loss": "logit_z_loss",
        "grad norm": "grad_norm",
        "grad-norm": "grad_norm",
        "global_norm": "grad_norm",
        "learning/raw_grad_norm": "grad_norm",
        "learning/grad_norm": "clipped_grad_norm",
        "learning rate": "lr",
        "learning_rate": "lr",
        "learning/current_learning_rate": "lr",
        "total_weights": "tokens",
        "learning/total_weights": "tokens",
        "some custom thing": "some custom thing",
    }
    for raw, canon in table.items():
        assert canonical_name(raw) == canon, raw
    assert is_canonical("mtp_3_loss") and is_canonical("tokens")
    assert not is_canonical("mtp_0_loss") and not is_canonical("clipped_grad_norm")


def test_parse_name_map_and_overrides(tmp_path):
    assert parse_name_map("a=b, lm loss = objective ,c=") == {"a": "b", "lm loss": "objective", "c": ""}
    assert parse_name_map("") == {} and parse_name_map(None) == {}
    with pytest.raises(ValueError, match="name_map: entry 'oops'"):
        parse_name_map("a=b,oops")
    with pytest.raises(ValueError, match="mapped twice"):
        parse_name_map("a=b,a=c")
    # raw name override, canonical rename, drop
    nm = parse_name_map("learning/mtp_loss=mtp_1_loss,objective=total,perf/step_time_seconds=-")
    assert canonical_name("learning/mtp_loss", nm) == "mtp_1_loss"
    assert canonical_name("learning/loss", nm) == "total"
    assert canonical_name("perf/step_time_seconds", nm) is None
    run = read_log(LOGS / "maxtext_metrics.jsonl", name_map=nm)
    assert "total" in run.metrics and "objective" not in run.metrics
    assert "perf/step_time_seconds" not in run.metrics


def test_two_raw_names_for_one_metric_is_an_error(tmp_path):
    log = tmp_path / "dup.jsonl"
    log.write_text('{"step": 1, "lm loss": 2.0, "learning/lm_loss": 2.0}\n')
    with pytest.raises(LogParseError, match="both map to 'lm_loss'"):
        read_log(log)
    run = read_log(log, name_map={"lm loss": "megatron_lm_loss"})
    assert_series(run.metrics["megatron_lm_loss"], {1: 2.0})


@pytest.mark.parametrize("order", ["alias first", "canonical first"])
def test_the_canonical_name_itself_wins_over_an_alias(tmp_path, order):
    """A LossParityTrainer trainer_state.json logs HF's `loss` and lossparity's `objective`: `objective` is the
    metric, `loss` keeps its own name (it used to make the whole log unreadable)."""
    entries = [{"loss": 5.25, "objective": 5.2512, "step": s} for s in (1, 2)]
    if order == "canonical first":
        entries = [{"objective": e["objective"], "loss": e["loss"], "step": e["step"]} for e in entries]
    log = tmp_path / "trainer_state.json"
    log.write_text(json.dumps({"log_history": entries, "global_step": 2}))
    run = read_log(log)
    assert_series(run.metrics["objective"], {1: 5.2512, 2: 5.2512})
    assert_series(run.metrics["loss"], {1: 5.25, 2: 5.25})


def test_with_constant_batch_size():
    run = read_log(LOGS / "maxtext_console.log").with_constant_batch_size(16)  # steps 0, 1, 2
    assert run.consumed_samples == {0: 16.0, 1: 32.0, 2: 48.0}
    with pytest.raises(ValueError, match="global_batch_size"):
        run.with_constant_batch_size(0)


def test_readers_need_neither_torch_nor_numpy():
    import os
    import subprocess
    import sys

    src = Path(__file__).resolve().parents[1] / "src"
    probe = (
        "import sys\n"
        "sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
        "from lossparity.parity import read_log\n"
        f"run = read_log({str(LOGS / 'megatron_restart.log')!r})\n"
        "assert run.metrics['lm_loss'][8] == 9.1234, run.metrics\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(src)},
    )
    assert out.returncode == 0, out.stderr


def test_parity_modules_do_not_import_torch():
    import subprocess
    import sys

    # load lossparity.parity with a stub parent package, so the package __init__ (torch) is not run
    root = Path(__file__).resolve().parents[1] / "src" / "lossparity"
    probe = (
        "import sys, types\n"
        f"pkg = types.ModuleType('lossparity'); pkg.__path__ = [{str(root)!r}]; sys.modules['lossparity'] = pkg\n"
        "import lossparity.parity\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# ---------------------------------------------------------------------------------------------------
# issue 15: real-world logs break readers in ways users hit daily (fixtures written for each defect)


def _cut_last_metric_line(src: Path, dst: Path, marker: str) -> int:
    """Copy ``src`` up to its last line containing ``marker``, cut in the middle of that line's last number
    and without a newline (a log still being written); return that line's 1-based number."""
    lines = src.read_text().splitlines()
    idx = max(i for i, line in enumerate(lines) if marker in line)
    line = lines[idx]
    cut = max(i for i, ch in enumerate(line) if ch.isdigit() and i > 0 and line[i - 1] == ".") + 1
    dst.write_text("\n".join(lines[:idx]) + "\n" + line[:cut])
    return idx + 1


LIVE_CASES = [  # (fixture, marker of a metric line, the step of the last metric line, metric)
    ("megatron_restart.log", "iteration", 8, "lm_loss"),
    ("maxtext_console.log", "completed step", 2, "objective"),
    ("torchtitan.log", "step:", 3, "objective"),
    ("mindformers.log", "Epoch:", 4, "objective"),
    ("torchtitan_losses.txt", " ", 5, "objective"),
    ("lossparity.jsonl", '"step"', 4, "lr"),
]


@pytest.mark.parametrize(("fixture", "marker", "last_step", "metric"), LIVE_CASES)
def test_live_log_last_line_is_ignored_with_a_note(tmp_path, fixture, marker, last_step, metric):
    # defect 1: before, the cut number (e.g. 9.12 of 9.1234) was read and compared
    full = read_log(LOGS / fixture)
    live = tmp_path / fixture
    ln = _cut_last_metric_line(LOGS / fixture, live, marker)
    run = read_log(live)
    assert run.live and any(f"last line {ln} ignored: incomplete" in n for n in run.notes)
    assert last_step in full.metrics[metric] and last_step not in run.metrics.get(metric, {})
    for step, value in run.metrics[metric].items():
        assert value == full.metrics[metric][step] or (math.isnan(value) and math.isnan(full.metrics[metric][step]))


def test_csv_row_still_being_written_is_ignored(tmp_path):
    log = tmp_path / "export.csv"
    log.write_text("step,loss,grad_norm\n1,2.5,1.0\n2,2.4,0.9\n3,2.3")  # the last row lacks a cell and a newline
    run = read_log(log)
    assert_series(run.metrics["objective"], {1: 2.5, 2: 2.4})
    assert run.live
    assert any("last line 4 ignored" in n for n in run.notes)
    log.write_text("step,loss\n1,2.5\n2,2.4")  # complete cells without a final newline: read
    assert_series(read_log(log).metrics["objective"], {1: 2.5, 2: 2.4})


def test_megatron_line_without_closing_bar_is_incomplete(tmp_path):
    # Megatron ends every complete metric line with '|': a line cut before it, even with a newline, is torn
    text = (LOGS / "megatron_restart.log").read_text().splitlines()
    last = max(i for i, line in enumerate(text) if "iteration" in line)
    log = tmp_path / "live.log"
    log.write_text("\n".join(text[:last]) + "\n" + text[last].rsplit("|", 3)[0] + "\n")
    run = read_log(log)
    assert 8 not in run.metrics["lm_loss"] and run.live
    assert any("ends with '|'" in n for n in run.notes)


def test_megatron_terminal_wrapped_lines_are_joined():
    run = read_log(LOGS / "megatron_wrapped.log")
    # iteration 1 was wrapped inside the number 1.104|512E+01; iteration 4 never completed (killed)
    assert_series(run.metrics["lm_loss"], {1: 11.04512, 2: 10.91873, 3: 10.77654})
    assert_series(run.metrics["load_balancing_loss"], {1: 1.012, 2: 1.0105, 3: 1.0098})
    assert sum("hard-wrapped" in n for n in run.notes) == 2
    assert any("line 7 ignored" in n for n in run.notes) and not run.live


@pytest.mark.parametrize(
    ("fmt", "text", "line", "needle"),
    [
        (
            "torchtitan",
            "[titan] 2025 - root - INFO - step:  1  loss:  4.6O72  grad_norm:  1.46  memory: 1.2GiB(0.9%)\n",
            1,
            "a number for 'loss', got '4.6O72'",
        ),
        (
            "mindformers",
            "- INFO - { Epoch:[  1/  2], step:[    1/   19], loss: 10.649, lr: 0.0, overflow cond: False, "
            "loss_scale: 1.0, global_norm: [1 31O49], train_throughput_per_npu: 2.896T\n",
            1,
            "'global_norm', got '[1 31O49]'",
        ),
        (
            "mindformers",
            "- INFO - { Epoch:[  1/  2], step:[    1/   19], loss: [10.649 3], lr: 0.0, overflow cond: False\n",
            1,
            "'loss', got '[10.649 3]'",
        ),
        (
            "megatron",
            " iteration        1/      10 | lm loss: 1.0823O0E+01 | grad norm: 5.4 |\n",
            1,
            "'lm loss', got '1.0823O0E+01'",
        ),
        ("maxtext", "completed step: 0, seconds: 1.0, total_weights: 10, loss: 10.8 7\n", 1, "'loss', got '10.8 7'"),
        ("jsonl", '{"step": 1, "loss": 2.5}\n{"step": 2, "loss": "2.4x"}\n', 2, "'loss', got '2.4x'"),
        ("csv", "step,loss\n1,2.5\n2,2.4x\n", 3, "column 'loss'"),
        ("torchtitan_losses", "1 8.04\n2 7.7S1\n", 2, "'<step> <loss>'"),
    ],
)
def test_incomplete_numbers_are_errors_naming_file_and_line(tmp_path, fmt, text, line, needle):
    # defect 2: before, 4.6O72 was cut to 4.6 and [1 31049] read as 1.0 (an array outside a loss field is now
    # skipped with a note: test_array_valued_field_is_skipped_with_a_note)
    log = tmp_path / "bad.log"
    log.write_text(text)
    with pytest.raises(LogParseError) as e:
        read_log(log, fmt=fmt)
    assert f"bad.log:{line}" in str(e.value) and needle in str(e.value)


def test_decorated_console_fields_still_read(tmp_path):
    run = read_log(LOGS / "torchtitan.log")  # memory: 18.42GiB(19.39%), tps: 1,234, mfu: 7.22%
    assert run.metrics["tps"][1] == 1234.0 and run.metrics["memory"][1] == 18.42 and run.metrics["mfu"][1] == 7.22


_MF_PREFIX = "2025-04-07 15:34:27,308 - [mindformers/core/callback/callback.py:529] - INFO - "


def test_array_valued_field_is_skipped_with_a_note(tmp_path):
    # issue 26 item 2: MindFormers' documentation log prints global_norm as an array on its first two steps;
    # before, the whole log was rejected although every loss was readable
    log = tmp_path / "mf.log"
    log.write_text(
        _MF_PREFIX
        + "{ Epoch:[  1/  2], step:[    1/   3], loss: 10.649, lr: 0.0, global_norm: [1 31049]\n"
        + _MF_PREFIX
        + "{ Epoch:[  1/  2], step:[    2/   3], loss: 10.633, lr: 1e-05, global_norm: [1, 508834]\n"
        + _MF_PREFIX
        + "{ Epoch:[  1/  2], step:[    3/   3], loss: 9.673, lr: 9e-06, global_norm [10.579812]\n"
    )
    run = read_log(log)
    assert run.metrics["objective"] == {1: 10.649, 2: 10.633, 3: 9.673}
    assert run.metrics["lr"] == {1: 0.0, 2: 1e-05, 3: 9e-06}
    assert run.metrics["grad_norm"] == {3: 10.579812}
    assert run.unreadable == {"grad_norm": "line 1: 'global_norm: [1 31049]'"}
    assert any("'global_norm' (grad_norm): 2 value(s) that are not one number skipped" in n for n in run.notes)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("[1 31049]", True), ("[0.5, 2]", True), (" [1e-3 nan 4] ", True), ("[4.56]", False), ("[1 31O49]", False)],
)
def test_is_number_array(text, expected):
    assert is_number_array(text) is expected


def test_hf_string_loss_is_an_error(tmp_path):
    log = tmp_path / "trainer_state.json"
    log.write_text(json.dumps({"log_history": [{"loss": 1.5, "step": 1}, {"loss": "abc", "step": 2}]}))
    with pytest.raises(LogParseError, match=r"log_history\[1\].*a number for 'loss', got 'abc'"):
        read_log(log)


def test_broken_or_empty_json_is_named_as_json(tmp_path):
    # defect 3: without --format a truncated trainer_state.json gave "expected a known log format"
    text = (LOGS / "trainer_state.json").read_text()
    cut = tmp_path / "trainer_state.json"
    cut.write_text(text[: len(text) // 2])
    with pytest.raises(
        LogParseError,
        match=r"trainer_state.json:\d+: expected valid JSON: the file is JSON but "
        r"broken at line \d+ column \d+",
    ):
        read_log(cut)
    empty = tmp_path / "empty.json"
    empty.write_text("\n")
    with pytest.raises(LogParseError, match="empty file"):
        read_log(empty)


def test_golden_legacy_list_form_and_top_level_scalar():
    # defect 4: values[i] is TensorBoard event 5i, i.e. iteration 5i + 1 (was 5i: one step early)
    run = read_log(LOGS / "golden_legacy_list.json")
    assert run.format == "megatron_golden"
    assert_series(run.metrics["lm_loss"], {1: 10.5, 6: 10.25, 11: 10.0})
    assert any("iteration_timing_avg" in n for n in run.notes)


def test_golden_nan_string_is_missing_and_total_loss_is_the_objective():
    run = read_log(LOGS / "golden_resumed.json")
    assert_series(run.metrics["lm_loss"], {4: 9.75, 5: 9.5, 6: 9.25})
    # "total loss" (distillation) is the optimized loss; a JSON NaN literal stays a NaN value
    assert_series(run.metrics["objective"], {4: 0.49, 5: 0.48, 6: math.nan})
    assert run.raw_names["objective"] == "total loss"


def test_hf_eval_predict_and_summary_entries():
    # defect 5: an entry without 'step' (predict_*) made the whole file unreadable
    run = read_log(LOGS / "trainer_state_eval_predict.json")
    assert_series(run.metrics["objective"], {10: 1.25, 20: 1.0})
    assert_series(run.metrics["eval_loss"], {10: 1.1})
    assert "predict_loss" not in run.metrics and "train_loss" not in run.metrics
    what = "(predict_* metrics, e.g. predict_loss: evaluation results, not training steps)"
    assert f"1 evaluation entries without a step ignored {what}" in run.notes


@pytest.mark.parametrize(
    ("fixture", "fmt", "metric", "expected", "step_base"),
    [
        (
            "torchtitan_losses.txt",
            "torchtitan_losses",
            "objective",
            {
                1: 10.875432014465332,
                2: 10.51230239868164,
                3: 9.98122787475586,
                4: 9.400251388549805,
                5: 8.91002368927002,
            },
            1,
        ),
        ("llamafactory_trainer_log.jsonl", "llamafactory", "objective", {5: 2.3125, 10: 2.0417, 15: 1.8833}, 1),
        ("maxtext_profiler.log", "maxtext", "objective", {0: 11.204, 1: 10.998, 2: 10.64, 3: 10.311, 4: 10.052}, 0),
        ("mindformers_no_colon.log", "mindformers", "grad_norm", {1: 12.503311, 2: 9.87445, 3: 7.120948}, 1),
        ("wandb_step0.csv", "csv", "objective", {0: 2.5, 1: 2.25, 2: 2.125}, 0),
    ],
)
def test_formats_users_have(fixture, fmt, metric, expected, step_base):
    # defects 6 and 9: new formats, MaxText profiler lines, MindFormers 'global_norm [x]', W&B Step from 0
    run = read_log(LOGS / fixture)
    assert run.format == fmt == detect_format(LOGS / fixture) and run.step_base == step_base
    assert_series(run.metrics[metric], expected)


def test_maxtext_profiler_steps_are_noted():
    run = read_log(LOGS / "maxtext_profiler.log")
    assert sum("profiler boundary step" in n for n in run.notes) == 2
    assert_series(run.metrics["mtp_loss"], {1: 0.097, 2: 0.095, 3: 0.093, 4: 0.091})


def test_lfs_pointer_is_named():
    with pytest.raises(LogParseError, match="Git LFS pointer"):
        read_log(LOGS / "tb_lfs_pointer")
    with pytest.raises(LogParseError, match="Git LFS pointer"):
        detect_format(LOGS / "tb_lfs_pointer" / "run1" / "events.out.tfevents.1700000000.host.1.0")


# ---------------------------------------------------------------------------------------------------
# the real logs of ../shared/reallogs (written outside this project; see SOURCES.md there)

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "reallogs"

# file -> (format, metric, number of points, first step, last step, step_base); or ("error", format, needle)
REAL_EXPECTED: dict[str, tuple] = {
    "golden_bert_resume_dev_h100.json": ("megatron_golden", "lm_loss", 100, 1, 100, 1),
    "golden_bert_resume_dev_h100_2nd.json": ("megatron_golden", "lm_loss", 50, 51, 100, 1),
    "golden_gpt_defer_wgrad_dev_a100.json": ("megatron_golden", "lm_loss", 11, 1, 50, 1),
    "golden_gpt_defer_wgrad_lts_a100.json": ("megatron_golden", "lm_loss", 11, 1, 50, 1),
    "golden_gpt_distill_total_loss_dev_h100.json": ("megatron_golden", "objective", 100, 1, 100, 1),
    "golden_gpt_tp1_pp2_fp16_legacy_dev_a100.json": ("megatron_golden", "lm_loss", 10, 1, 46, 1),
    "golden_mixtral_8x7b_dev_h100.json": ("megatron_golden", "lm_loss", 41, 1, 200, 1),
    "golden_mixtral_8x7b_lts_a100.json": ("megatron_golden", "lm_loss", 41, 1, 200, 1),
    "golden_moe_mtp_fp8_dev_h100.json": ("megatron_golden", "mtp_1_loss", 11, 1, 50, 1),
    "golden_nemotron_mtp2_dev_gb200.json": ("megatron_golden", "mtp_2_loss", 20, 1, 20, 1),
    "golden_t5_listform_lts_a100.json": ("megatron_golden", "lm_loss", 20, 1, 96, 1),
    "hf_runs_lfs_pointer": ("error", "tensorboard", "Git LFS pointer"),
    "hf_trainer_state_cpt_seq2seq.json": ("hf_trainer_state", "objective", 10, 500, 5000, 1),
    "hf_trainer_state_tinyllama_sft.json": ("hf_trainer_state", "objective", 186, 15, 2790, 1),
    "llamafactory_trainer_log_mistral_translator.jsonl": ("llamafactory", "objective", 10, 10, 100, 1),
    "maxtext_deepseek2_16b_docs.log": ("maxtext", "objective", 10, 0, 9, 0),
    "maxtext_maxtest_getting_started.log": ("maxtext", "objective", 5, 0, 4, 0),
    "megatron_gpt2_345m_4pp.log": ("megatron", "lm_loss", 20, 100, 2000, 1),
    "megatron_gpt2_345m_4tp.log": ("megatron", "lm_loss", 20, 100, 2000, 1),
    "megatron_lm_fl_qwen3_default0_prefix.log": ("megatron", "lm_loss", 2, 3, 4, 1),
    "megatron_mixtral_issue756_excerpt.log": ("megatron", "load_balancing_loss", 6, 29, 45, 1),
    "megatron_moe_ep1_clean_2024.log": ("megatron", "lm_loss", 5, 2, 6, 1),
    "megatron_moe_ep2_terminal_wrapped.log": ("megatron", "load_balancing_loss", 5, 1, 5, 1),
    "mindformers_llama2_13b_docs.log": ("mindformers", "objective", 5, 1, 5, 1),
    "mindformers_llama3_1_8b_skip_docs.log": ("mindformers", "grad_norm", 2, 1, 2, 1),
    "torchtitan_llama3_debug_h200_10steps.log": ("torchtitan", "objective", 10, 1, 10, 1),
    "torchtitan_losscompare_llama3_cuda.txt": ("torchtitan_losses", "objective", 100, 1, 100, 1),
    "torchtitan_losscompare_llama3_rocm_mi350x.txt": ("torchtitan_losses", "objective", 100, 1, 100, 1),
    "torchtitan_pr2389_multirank_excerpt.log": ("torchtitan", "objective", 2, 4, 5, 1),
    "torchtitan_pr3393_excerpt.log": ("torchtitan", "objective", 8, 14, 21, 1),
    "wandb_export_brisk_pond_train_loss.csv": ("csv", "objective", 94, 0, 93, 0),
}

needs_real = pytest.mark.skipif(not REAL.is_dir(), reason="../shared/reallogs is not present in this checkout")


@needs_real
def test_every_real_log_has_an_expectation():
    present = sorted(p.name for p in REAL.iterdir() if p.name != "SOURCES.md")
    assert present == sorted(REAL_EXPECTED)
    assert len(present) == 31


@needs_real
@pytest.mark.parametrize("name", sorted(REAL_EXPECTED))
def test_real_log_is_detected_and_read(name):
    exp = REAL_EXPECTED[name]
    path = REAL / name
    if exp[0] == "error":
        with pytest.raises(LogParseError) as e:
            assert detect_format(path) == exp[1]
            read_log(path)
        assert exp[2] in str(e.value)
        return
    fmt, metric, n, first, last, base = exp
    run = read_log(path)
    assert run.format == fmt and run.step_base == base
    steps = sorted(run.metrics[metric])
    assert (len(steps), steps[0], steps[-1]) == (n, first, last)
    assert all(math.isfinite(v) for v in run.metrics[metric].values())


_TITAN_COLORS = {
    "step:": "\x1b[31m",
    "loss:": "\x1b[32m",
    "grad_norm:": "\x1b[38;2;180;60;0m",
    "memory:": "\x1b[38;2;54;234;195m",
    "tps:": "\x1b[34m",
    "tflops:": "\x1b[36m",
    "mfu:": "\x1b[35m",
}


@needs_real
def test_real_torchtitan_log_with_ansi_colours(tmp_path):
    # derived as SOURCES.md describes: the fields wrapped in the escape codes of torchtitan's Color class
    plain = REAL / "torchtitan_llama3_debug_h200_10steps.log"
    out = []
    for line in plain.read_text().splitlines():
        if " - INFO - step:" in line:
            for key, code in _TITAN_COLORS.items():
                line = line.replace(f"  {key}", f"  {code}{key}").replace(f"INFO - {key}", f"INFO - {code}{key}")
            line += "\x1b[39m"
        out.append(line)
    coloured = tmp_path / "coloured.log"
    coloured.write_text("\n".join(out) + "\n")
    assert "\x1b[32mloss:" in coloured.read_text()
    a, b = read_log(plain), read_log(coloured)
    assert b.format == "torchtitan" and b.metrics == a.metrics and len(b.metrics["objective"]) == 10


@needs_real
def test_real_golden_values_written_as_tensorboard_events(tmp_path):
    # derived as SOURCES.md describes: Megatron-style tags from the real golden values, read back cross-format
    pytest.importorskip("tensorboard")
    golden = read_log(REAL / "golden_moe_mtp_fp8_dev_h100.json")
    events = [
        (s, {"lm loss": v, "mtp_1 loss": golden.metrics["mtp_1_loss"][s]}) for s, v in golden.metrics["lm_loss"].items()
    ]
    events += [(4 * s, {"lm loss vs samples": v}) for s, v in golden.metrics["lm_loss"].items()]
    _write_events(tmp_path / "tb", "events.out.tfevents.1700000000.node0.1.0", events)
    tb = read_log(tmp_path / "tb")
    assert tb.consumed_samples == {s: 4.0 * s for s in golden.metrics["lm_loss"]}
    from lossparity.parity import compare_runs

    res = compare_runs(golden, tb)  # float32 event values against 5-digit JSON values
    assert res.passed and set(res.metrics) == {"lm_loss", "mtp_1_loss"} and res.metrics["lm_loss"].n_compared == 11
