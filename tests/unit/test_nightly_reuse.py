"""Incremental nightly runs, the parts without servers: the request hash, the replay
check, the catalog read twice, the jobs file's ``incremental`` and the report line."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest

from batchgen.domain.formats.admission import canonical_text
from batchgen.errors import Conflict, ValidationFailed
from batchgen.nightly import Job, PromptRenderer, RunReport, load_jobs
from batchgen.nightly.catalog import requests
from batchgen.nightly.reruns import changed_since, request_sha256
from batchgen.nightly.reuse import plan, to_describe

LINE = {
    "custom_id": "p1",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {
        "model": "sim-small",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "About Lamp 1 (10.00 EUR)."}],
    },
}


def _with(body_change: dict) -> dict:
    return {**LINE, "body": {**LINE["body"], **body_change}}


def test_the_hash_is_of_the_canonical_request_without_its_key():
    body = dict(reversed(list(LINE["body"].items())))
    reordered = dict(reversed(list({**LINE, "body": body}.items())))
    assert list(reordered) != list(LINE) and list(reordered["body"]) != list(LINE["body"])
    assert canonical_text(reordered) == canonical_text(LINE)  # one spelling
    assert request_sha256(reordered) == request_sha256(LINE)
    assert request_sha256({**LINE, "custom_id": "other"}) == request_sha256(LINE)
    changes = [
        _with({"messages": [{"role": "user", "content": "About Lamp 1 (12.00 EUR)."}]}),
        _with({"max_tokens": 9}),
        _with({"model": "sim-large"}),
        _with({"temperature": 0.2}),
        _with(
            {"messages": [{"role": "system", "content": "Be brief."}, *LINE["body"]["messages"]]}
        ),
        {**LINE, "url": "/v1/responses"},
    ]
    hashes = {request_sha256(line) for line in changes}
    assert len(hashes) == len(changes) and request_sha256(LINE) not in hashes


def test_a_replay_finds_every_reused_request_unchanged():
    assert changed_since({"a": "h1"}, {"a": "h1", "b": "h2"}) is None
    assert changed_since({}, {"a": "h1"}) is None
    assert changed_since({"a": "h1", "b": "h2"}, {"a": "h1", "b": "h3"}) == "b"
    assert changed_since({"a": "h1"}, {"b": "h2"}) == "a"  # gone from the catalog


def _job(tmp_path: Path, rows: list[str]) -> Job:
    (tmp_path / "catalog.csv").write_text("id,name,price\n" + "".join(f"{r}\n" for r in rows))
    (tmp_path / "t.j2").write_text("About {{ product.name }} ({{ product.price }} EUR).")
    return Job(
        name="lamps",
        tenant="acme",
        model="sim-small",
        catalog=tmp_path / "catalog.csv",
        output=tmp_path / "out.jsonl",
        template=tmp_path / "t.j2",
        max_tokens=8,
    )


def test_the_second_reading_submits_the_unreused_and_checks_each(tmp_path):
    job = _job(tmp_path, ["p1,Lamp 1,10", "p2,Lamp 2,", "p3,Lamp 3,12", "p4,Lamp 4,13"])
    renderer = PromptRenderer(job)
    rejects: list = []
    planned = plan(job, requests(job, renderer, rejects))
    assert list(planned) == ["p1", "p3", "p4"] and [r.id for r in rejects] == ["p2"]
    reused = {"p3": planned["p3"]}
    again = [line["custom_id"] for line in to_describe(job, renderer, planned, reused)]
    assert again == ["p1", "p4"]
    assert list(to_describe(job, renderer, planned, dict(planned))) == []  # all reused

    _job(tmp_path, ["p1,Lamp 1,10", "p3,Lamp 3,12", "p4,Lamp 4,14"])  # p4's price changed
    with pytest.raises(Conflict, match="catalog changed"):
        list(to_describe(job, renderer, planned, reused))
    _job(tmp_path, ["p1,Lamp 1,10", "p3,Lamp 3,12"])  # p4 gone
    with pytest.raises(Conflict, match="catalog changed"):
        list(to_describe(job, renderer, planned, reused))


def test_a_product_twice_in_the_catalog_is_refused(tmp_path):
    job = _job(tmp_path, ["p1,Lamp 1,10", "p2,Lamp 2,11", "p1,Lamp 1b,12"])
    with pytest.raises(ValidationFailed, match="'p1' is in the catalog twice"):
        plan(job, requests(job, PromptRenderer(job), []))


def test_jobs_are_incremental_unless_the_file_says_false(tmp_path):
    common = 'tenant = "acme"\nmodel = "sim-small"\ncatalog = "c.csv"\noutput = "o.jsonl"\n'
    path = tmp_path / "jobs.toml"
    path.write_text(
        f'[[jobs]]\nname = "a"\n{common}\n[[jobs]]\nname = "b"\nincremental = false\n{common}'
    )
    assert [j.incremental for j in load_jobs(path)] == [True, False]


def test_the_report_line_counts_the_reused_products():
    report = RunReport(
        job="lamps",
        date="2030-01-02",
        batches=[],
        products=9,
        written=9,
        succeeded=0,
        failed=0,
        expired=0,
        cancelled=0,
        rejected=1,
        reused=9,
        prompt_tokens=0,
        completion_tokens=0,
        cost_usd=Decimal(0),
    )
    assert report.line() == (
        "nightly job=lamps date=2030-01-02 products=9 written=9 succeeded=0 failed=0 "
        "expired=0 cancelled=0 rejected=1 reused=9 prompt_tokens=0 completion_tokens=0 "
        "cost_usd=0.000000 batches="
    )
    assert report.as_dict()["reused"] == 9


def test_a_runs_parts_keep_within_lines_and_bytes():
    """A long shared system prompt makes a part's text large long before its line
    count is: parts are cut at whichever bound comes first, in order."""
    from batchgen.nightly.catalog import parts

    lines = [{"custom_id": f"p{i}", "body": {"system": "x" * 100}} for i in range(10)]
    size = len(json.dumps(lines[0])) + 1
    by_lines = list(parts(lines, max_lines=4, max_bytes=10**9))
    assert [len(p) for p in by_lines] == [4, 4, 2]
    by_bytes = list(parts(lines, max_lines=100, max_bytes=3 * size))
    assert [len(p) for p in by_bytes] == [3, 3, 3, 1]
    assert [line for part in by_bytes for line in part] == lines
    alone = list(parts(lines[:2], max_lines=100, max_bytes=size // 2))
    assert [len(p) for p in alone] == [1, 1]  # each over the bound: alone, for admission
