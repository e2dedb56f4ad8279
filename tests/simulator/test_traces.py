import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from routewise_vllm.simulator.traces import (
    KNOWN_TRACES,
    TRACES_DIR_ENV,
    TraceError,
    TraceLibrary,
    read_azure_csv,
    read_lengths_csv,
    read_mooncake_jsonl,
    SHIPPED_TRACES_DIR,
    split_window,
    spread_in_buckets,
    trace_path,
    traces_dir,
)

DATA = Path(__file__).resolve().parent.parent / "data"


def test_azure_timestamps_are_exact_and_relative_to_first_row_across_midnight():
    trace = read_azure_csv(DATA / "azure_good.csv")
    # 23:59:58.5, 23:59:59.0000001, 00:00:00.1 (next day), 00:00:02
    assert trace.arrival_s.tolist() == [0.0, 0.5000001, 1.6, 3.5]
    assert trace.prompt_tokens.tolist() == [100, 200, 300, 400]
    assert trace.output_tokens.tolist() == [10, 20, 30, 40]
    assert trace.block_ids == ((), (), (), ())


def test_azure_bad_token_count_names_file_line_field_value():
    with pytest.raises(TraceError) as err:
        read_azure_csv(DATA / "azure_bad_tokens.csv")
    assert str(err.value) == "azure_bad_tokens.csv:3: field 'ContextTokens': expected positive int, got \"abc\""


def test_azure_bad_time_of_day_names_line_and_field():
    with pytest.raises(TraceError, match=r"azure_bad_time\.csv:4: field 'TIMESTAMP'.*25:00:01"):
        read_azure_csv(DATA / "azure_bad_time.csv")


def test_on_error_warn_skips_rows_loudly_and_records_them():
    with pytest.warns(UserWarning, match="skipped 1 malformed row"):
        trace = read_azure_csv(DATA / "azure_bad_tokens.csv", on_error="warn")
    assert len(trace) == 1
    assert trace.skipped == ("azure_bad_tokens.csv:3: field 'ContextTokens': expected positive int, got \"abc\"",)


def test_on_error_rejects_unknown_mode():
    with pytest.raises(ValueError, match="on_error"):
        read_azure_csv(DATA / "azure_good.csv", on_error="skip")


def test_wrong_header_is_an_error(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("time,prompt,output\n2023-11-16 18:00:00,1,1\n")
    with pytest.raises(TraceError, match=r"x\.csv:1: expected header"):
        read_azure_csv(path)


def test_mooncake_parses_blocks_and_detects_3s_buckets():
    trace = read_mooncake_jsonl(DATA / "mooncake_good.jsonl")
    assert len(trace) == 8
    assert trace.bucket_s == pytest.approx(3.0)
    assert trace.block_ids[1] == (0, 1, 2)
    assert trace.arrival_s.tolist() == [0, 0, 0, 3, 3, 6, 6, 9]
    assert trace.block_tokens == 512


def test_mooncake_bad_value_message_matches_the_documented_form():
    with pytest.raises(TraceError) as err:
        read_mooncake_jsonl(DATA / "mooncake_bad_length.jsonl")
    assert str(err.value) == "mooncake_bad_length.jsonl:3: field 'input_length': expected positive int, got \"abc\""


def test_mooncake_hash_count_must_match_input_length():
    with pytest.raises(TraceError, match=r"mooncake_bad_hashes\.jsonl:1: field 'hash_ids'.*got 3"):
        read_mooncake_jsonl(DATA / "mooncake_bad_hashes.jsonl")


def test_mooncake_rejects_non_json_and_missing_fields(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\nnot json\n')
    with pytest.raises(TraceError, match=r"t\.jsonl:2: field 'row'"):
        read_mooncake_jsonl(path)
    path.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": [0]}\n')
    with pytest.raises(TraceError, match=r"t\.jsonl:1: field 'output_length': expected present"):
        read_mooncake_jsonl(path)
    path.write_text('{"timestamp": true, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n')
    with pytest.raises(TraceError, match=r"field 'timestamp'"):
        read_mooncake_jsonl(path)


def test_unquantised_timestamps_get_no_bucket(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text(
        "".join(f'{{"timestamp": {t}, "input_length": 10, "output_length": 1, "hash_ids": [{i}]}}\n'
                for i, t in enumerate([0, 40, 277, 471, 529, 639]))
    )
    assert read_mooncake_jsonl(path).bucket_s == 0.0


def test_bucket_spreading_is_seeded_sorted_and_stays_in_its_bucket():
    trace = read_mooncake_jsonl(DATA / "mooncake_good.jsonl")
    raw = trace.arrival_s
    a = spread_in_buckets(raw, trace.bucket_s, np.random.default_rng(7))
    b = spread_in_buckets(raw, trace.bucket_s, np.random.default_rng(7))
    c = spread_in_buckets(raw, trace.bucket_s, np.random.default_rng(8))
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()
    assert np.all(np.diff(a) >= 0)
    # each bucket's spread arrivals lie in [t, t + 3): the sorted arrivals line up with the sorted raw buckets
    assert np.all(a >= raw) and np.all(a < raw + 3.0)
    assert len(np.unique(a)) == len(a)  # sub-second order, not ties


def test_spreading_never_crosses_into_a_narrower_next_bucket():
    raw = np.array([0.0, 0.0, 0.0, 2.999, 2.999])
    for seed in range(20):
        out = spread_in_buckets(raw, 3.0, np.random.default_rng(seed))
        assert np.all(out[:3] < 2.999) and np.all(out[3:] >= 2.999)


def test_lengths_csv_good_and_bad():
    trace = read_lengths_csv(DATA / "lengths_good.csv")
    assert not trace.timed and len(trace) == 10
    with pytest.raises(TraceError, match=r"lengths_bad\.csv:3: field 'num_decode_tokens'.*got \"-5\""):
        read_lengths_csv(DATA / "lengths_bad.csv")
    assert len(trace.split_rows("train")) == 7 and trace.split_rows("eval").prompt_tokens.tolist() == [800, 900, 1000]


def test_window_uses_raw_timestamps_half_open():
    trace = read_azure_csv(DATA / "azure_good.csv")
    assert trace.window(0.5000001, 3.5).prompt_tokens.tolist() == [200, 300]
    assert len(trace.window(10, 20)) == 0


def test_split_windows_follow_the_traces_readme():
    assert split_window("azure-conv", "train") == (0.0, 2400.0)
    assert split_window("azure-code", "eval")[0] == 2400.0
    assert split_window("mooncake-synthetic", "train") == (0.0, 600.0)
    assert split_window("arxiv-lengths", "train") is None
    with pytest.raises(KeyError, match="known: azure-conv"):
        split_window("nope", "train")


def _fake_traces_root(tmp_path: Path) -> Path:
    (tmp_path / "azure_llm_2023").mkdir()
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for s in [0, 1000, 2399, 2400, 2401, 3000]:
        rows.append(f"2023-11-16 10:{s // 60:02d}:{s % 60:02d}.0000000,{s + 1},5")
    (tmp_path / KNOWN_TRACES["azure-conv"].relative_path).write_text("\n".join(rows) + "\n")
    return tmp_path


def test_library_caches_and_splits_by_window(tmp_path):
    lib = TraceLibrary(_fake_traces_root(tmp_path))
    assert lib.load("azure-conv") is lib.load("azure-conv")
    assert lib.split("azure-conv", "train").prompt_tokens.tolist() == [1, 1001, 2400]
    assert lib.split("azure-conv", "eval").prompt_tokens.tolist() == [2401, 2402, 3001]
    with pytest.raises(TraceError, match=r"trace 'azure-code' not found .*AzureLLMInferenceTrace_code.csv\[\.gz\]"):
        lib.load("azure-code")


def test_traces_dir_env_var(monkeypatch, tmp_path):
    monkeypatch.setenv(TRACES_DIR_ENV, str(tmp_path))
    assert traces_dir() == tmp_path
    monkeypatch.delenv(TRACES_DIR_ENV)
    assert traces_dir() == SHIPPED_TRACES_DIR
    assert trace_path("azure-conv") == SHIPPED_TRACES_DIR / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv.gz"


# The request counts the published traces README gives for the original files.
README_COUNTS = {
    "azure-conv": 19366,
    "azure-code": 8819,
    "mooncake-conversation": 12031,
    "mooncake-synthetic": 3993,
    "arxiv-lengths": 28257,
}


def test_real_traces_parse_completely():
    """The shipped copies: every row parses, counts as published (no skipped or lost rows)."""
    assert set(README_COUNTS) == set(KNOWN_TRACES)
    lib = TraceLibrary()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, count in README_COUNTS.items():
            trace = lib.load(name)
            assert len(trace) == count == KNOWN_TRACES[name].requests, name
            assert trace.skipped == ()
    assert lib.load("mooncake-conversation").bucket_s == pytest.approx(3.0)
    assert lib.load("mooncake-synthetic").bucket_s == 0.0
    # README: Azure code spans 57 min, Mooncake synthetic 17 min
    assert 56 * 60 < lib.load("azure-code").duration_s < 58 * 60
    assert 16 * 60 < lib.load("mooncake-synthetic").duration_s < 18 * 60
