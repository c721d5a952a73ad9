"""Reading the trainer's event files as they are written (``observe.record.EventTail``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from antifragile.chaos.observe.record import EventLogError, EventTail, RunRecord
from antifragile.chaos.run.runner import ChaosRunError, _read


def _line(t: float, event: str, **fields: object) -> str:
    return json.dumps({"t": t, "rank": 0, "attempt": 0, "event": event, **fields}) + "\n"


def _events(tmp_path: Path, text: str | bytes, name: str = "rank0.jsonl") -> Path:
    folder = tmp_path / "events"
    folder.mkdir(exist_ok=True)
    path = folder / name
    with open(path, "ab") as f:
        f.write(text.encode() if isinstance(text, str) else text)
    return path


def test_a_garbled_complete_line_is_an_error_naming_the_file_and_the_line(
        tmp_path: Path) -> None:
    """A torn line that the next attempt's first line completed: never skipped (the lost event
    could be the ckpt_committed a verdict rests on), never a bare JSONDecodeError."""
    tail = EventTail(tmp_path)
    path = _events(tmp_path, _line(1.0, "start", pid=1))
    assert [e["event"] for e in tail.poll()] == ["start"]
    _events(tmp_path, '{"t": 2.0, "rank": 0, "attempt": 0, "ev' + _line(3.0, "start", pid=2))
    with pytest.raises(EventLogError, match=rf"^{path}:2: not a JSON event"):
        tail.poll()
    with pytest.raises(ChaosRunError, match=rf"cannot be judged.*{path}:2:"):
        _read(tail)


@pytest.mark.parametrize("line", ['[1, 2]\n', '{"t": 1.0, "rank": 0, "event": "start"}\n',
                                  '{"t": "x", "rank": 0, "attempt": 0, "event": "start"}\n',
                                  # no time: every comparison with it is false, so a window
                                  # lookup skips it, and it sorts anywhere
                                  '{"t": NaN, "rank": 0, "attempt": 0, "event": "start"}\n',
                                  '{"t": Infinity, "rank": 0, "attempt": 0, "event": "x"}\n'])
def test_a_line_that_is_no_event_is_an_error(tmp_path: Path, line: str) -> None:
    path = _events(tmp_path, _line(1.0, "start", pid=1) + "\n" + line)
    with pytest.raises(EventLogError, match=rf"^{path}:3: not an event"):
        EventTail(tmp_path).poll()


def test_a_line_being_written_waits_for_its_end(tmp_path: Path) -> None:
    tail = EventTail(tmp_path)
    whole = _line(1.0, "step_end", step=1).encode()
    _events(tmp_path, whole[:10])
    assert tail.poll() == []
    _events(tmp_path, whole[10:])
    assert [e["step"] for e in tail.poll()] == [1]
    assert tail.poll() == []


def test_offsets_count_bytes_as_written(tmp_path: Path) -> None:
    """A line ending in CRLF (a script's own writer) and a non-ASCII field cut in the middle of
    a character by the read: each event is read once, whole."""
    tail = EventTail(tmp_path)
    _events(tmp_path, _line(1.0, "step_end", step=1).replace("\n", "\r\n"))
    assert [e["step"] for e in tail.poll()] == [1]
    text = json.dumps({"t": 2.0, "rank": 0, "attempt": 0, "event": "note", "what": "é"},
                      ensure_ascii=False).encode() + b"\n"
    cut = text.index("é".encode()) + 1
    _events(tmp_path, text[:cut])
    assert tail.poll() == []
    _events(tmp_path, text[cut:] + _line(3.0, "step_end", step=2).encode())
    assert [(e["event"], e.get("what")) for e in tail.poll()] == [("note", "é"),
                                                                 ("step_end", None)]
    assert [e["t"] for e in tail.events] == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("writer", ["trainer", "engine"])
def test_a_line_torn_by_a_killed_writer_is_not_glued_to_the_next_attempts(
        tmp_path: Path, writer: str) -> None:
    """A rank SIGKILLed in the middle of a line (between the pages of one write) leaves it
    without its newline; the next attempt's writer appended its first line to it, and the
    garbled line left the whole run without a verdict. The next writer cuts the torn tail
    off (the line it never finished is lost, as a kill may lose it) and appends after it."""
    from antifragile.engine._events import Channel
    from antifragile.trainer.events import EventLog, read_events

    path = _events(tmp_path, _line(1.0, "start", pid=1) + '{"t": 2.0, "rank": 0, "ev')
    if writer == "trainer":
        log = EventLog(str(tmp_path), 0, 1)
        log.emit("start", pid=2)
        log.close()
    else:
        Channel(str(tmp_path), rank=0, world_size=1, attempt=1)._file.close()
    assert [(e["attempt"], e["event"]) for e in EventTail(tmp_path).poll()] == [
        (0, "start"), (1, "start")]
    assert len(read_events(tmp_path)) == 2
    assert path.read_text().count("\n") == 2


def test_an_attempt_begins_at_its_first_start_whatever_order_the_events_came_in() -> None:
    """Events are read file by file, a poll at a time: rank 1's start of attempt 1 (t=9) may
    come after rank 0's (t=10). The attempt was taken to begin at whichever came first in
    the list, so a fault at t=9.5 was put on attempt 0, which had ended."""
    events = [{"t": 0.0, "rank": r, "attempt": 0, "event": "start"} for r in (0, 1)]
    events += [{"t": 10.0, "rank": 0, "attempt": 1, "event": "start"},
               {"t": 9.0, "rank": 1, "attempt": 1, "event": "start"}]
    record = RunRecord(0, 0.0, 20.0, events, [])
    assert record.attempt_at(9.5) == 1 and record.attempt_at(8.0) == 0
