"""The coordinator's journal: what a restarted coordinator finds, and nothing else."""

from __future__ import annotations

from pathlib import Path

from node_agent.journal import Entry, Journal, key_name


def test_what_was_added_and_not_removed_is_what_the_next_run_finds(tmp_path: Path) -> None:
    directory = tmp_path / "plant" / "coordinator"
    journal = Journal(directory)
    assert journal.open() == []  # a first run: nothing, and no directory made for it
    kept = Entry("plc-1", "job-7", b'{"id": "job-7", "prompt": "x"}', "replies/7", b"\x00\xff")
    done = Entry("plc-1", "..", b'{"id": "..", "prompt": "y"}')  # an id that names no path
    journal.add(kept)
    journal.add(done)
    journal.remove("plc-1", "..")
    assert Journal(directory).open() == [kept]
    assert sorted(p.name for p in directory.iterdir()) == [key_name("plc-1", "job-7")]
    journal.remove("plc-1", "job-7")
    assert not (tmp_path / "plant").exists()  # an empty journal leaves nothing behind


def test_an_unreadable_entry_is_set_aside_not_fatal(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    good = Entry("plc", "a", b"{}")
    journal.add(good)
    (tmp_path / "0bad.json").write_text("{not json")
    (tmp_path / ".cut-short.tmp").write_text("{")  # a write a crash interrupted
    assert Journal(tmp_path).open() == [good]
    assert (tmp_path / "0bad.bad").exists() and not (tmp_path / ".cut-short.tmp").exists()
