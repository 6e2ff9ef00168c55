"""SQLite storage of records, alerts, control advice and detector state (stdlib only).

Tables::

    records(run_id, attempt, iteration, kind, time, received, data)   -- data: the record as JSON
        PRIMARY KEY (run_id, attempt, iteration, kind)                -- idempotent: resends are ignored
    metrics(run_id, attempt, iteration, kind, name, value)            -- every numeric field, long form
    alerts(id, run_id, attempt, iteration, rule, severity, confirmed, message, data, created)
    advice(seq, run_id, iteration, action, factor, to_iteration, data, created)
    detector_state(run_id, state, updated)

Non-finite values are kept in ``records.data`` (JSON NaN/Infinity tokens); in
``metrics.value`` NaN becomes NULL (SQLite has no NaN) and +-Inf stay.
"""
from __future__ import annotations

import json
import math
import sqlite3
import time
from pathlib import Path
from typing import Optional

from .alerts import Alert, ControlAdvice
from .records import numeric_fields

SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    run_id TEXT NOT NULL, attempt INTEGER NOT NULL, iteration INTEGER NOT NULL, kind TEXT NOT NULL,
    time REAL, received REAL NOT NULL, data TEXT NOT NULL,
    PRIMARY KEY (run_id, attempt, iteration, kind)
);
CREATE TABLE IF NOT EXISTS metrics (
    run_id TEXT NOT NULL, attempt INTEGER NOT NULL, iteration INTEGER NOT NULL, kind TEXT NOT NULL,
    name TEXT NOT NULL, value REAL,
    PRIMARY KEY (run_id, attempt, iteration, kind, name)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS alerts (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, attempt INTEGER NOT NULL,
    iteration INTEGER NOT NULL, rule TEXT NOT NULL, severity TEXT NOT NULL, confirmed INTEGER NOT NULL,
    message TEXT NOT NULL, data TEXT NOT NULL, created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS advice (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, iteration INTEGER NOT NULL,
    action TEXT NOT NULL, factor REAL, to_iteration INTEGER, data TEXT NOT NULL, created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS detector_state (
    run_id TEXT PRIMARY KEY, state TEXT NOT NULL, updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS alerts_run ON alerts (run_id, iteration);
CREATE INDEX IF NOT EXISTS advice_run ON advice (run_id, seq);
"""


def _sql_value(v: float) -> Optional[float]:
    return None if math.isnan(v) else v


class Store:
    """One connection, used under the caller's lock (the sidecar serialises ingest)."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("PRAGMA busy_timeout=5000")
        self.conn.executescript(SCHEMA)

    # -------------------------------------------------------------- writes (inside begin/commit)
    def begin(self) -> None:
        self.conn.execute("BEGIN")

    def commit(self) -> None:
        self.conn.execute("COMMIT")

    def rollback(self) -> None:
        try:
            self.conn.execute("ROLLBACK")
        except sqlite3.OperationalError:
            pass

    def insert_record(self, rec: dict, received: float, numeric: Optional[dict] = None) -> bool:
        """Insert one normalised record; False if its key was already stored (a resend)."""
        return bool(self.insert_records([(rec, numeric)], received))

    def insert_records(self, items: list, received: float) -> list[int]:
        """Insert ``[(record, numeric_fields or None)]``; return the indices that were new."""
        new, rows = [], []
        execute = self.conn.execute
        for idx, (rec, numeric) in enumerate(items):
            key = (rec["run_id"], rec["attempt"], rec["iteration"], rec["kind"])
            cur = execute("INSERT OR IGNORE INTO records (run_id, attempt, iteration, kind, time, received, data) "
                          "VALUES (?, ?, ?, ?, ?, ?, ?)",
                          key + (rec.get("time"), received, json.dumps(rec, separators=(",", ":"))))
            if cur.rowcount == 0:
                continue
            new.append(idx)
            numeric = numeric if numeric is not None else numeric_fields(rec)
            rows.extend(key + (name, _sql_value(v)) for name, v in numeric.items())
        if rows:
            self.conn.executemany("INSERT OR REPLACE INTO metrics (run_id, attempt, iteration, kind, name, value) "
                                  "VALUES (?, ?, ?, ?, ?, ?)", rows)
        return new

    def insert_alert(self, alert: Alert) -> None:
        from .records import dumps_strict

        self.conn.execute(
            "INSERT INTO alerts (run_id, attempt, iteration, rule, severity, confirmed, message, data, created) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (alert.run_id, alert.attempt, alert.iteration, alert.rule, alert.severity, int(alert.confirmed),
             alert.message, dumps_strict(alert.to_dict()), time.time()))

    def insert_advice(self, advice: ControlAdvice) -> int:
        cur = self.conn.execute(
            "INSERT INTO advice (run_id, iteration, action, factor, to_iteration, data, created) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (advice.run_id, advice.iteration, advice.action, advice.factor, advice.to_iteration,
             json.dumps(advice.to_dict()), time.time()))
        advice.seq = int(cur.lastrowid)
        return advice.seq

    def save_detector_state(self, run_id: str, state: dict) -> None:
        from .records import dumps_strict

        self.conn.execute("INSERT OR REPLACE INTO detector_state (run_id, state, updated) VALUES (?, ?, ?)",
                          (run_id, dumps_strict(state), time.time()))

    # -------------------------------------------------------------- reads
    def load_detector_states(self) -> dict[str, dict]:
        return {r: json.loads(s) for r, s in self.conn.execute("SELECT run_id, state FROM detector_state")}

    def advice_after(self, run_id: str, after: int, limit: int = 64) -> list[ControlAdvice]:
        rows = self.conn.execute("SELECT seq, data FROM advice WHERE run_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                                 (run_id, after, limit)).fetchall()
        out = []
        for seq, data in rows:
            adv = ControlAdvice.from_dict(json.loads(data))
            adv.seq = seq
            out.append(adv)
        return out

    def latest_advice(self) -> dict[str, ControlAdvice]:
        out = {}
        for seq, run_id, data in self.conn.execute(
                "SELECT seq, run_id, data FROM advice WHERE seq IN (SELECT MAX(seq) FROM advice GROUP BY run_id)"):
            adv = ControlAdvice.from_dict(json.loads(data))
            adv.seq = seq
            out[run_id] = adv
        return out

    def count_records(self) -> int:
        return int(self.conn.execute("SELECT COUNT(*) FROM records").fetchone()[0])

    def close(self) -> None:
        try:
            self.conn.close()
        except sqlite3.Error:
            pass


def list_runs(db_path: str | Path) -> list[tuple[str, int, float]]:
    """``[(run_id, n_records, last_received)]`` newest first."""
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return [tuple(r) for r in conn.execute(
            "SELECT run_id, COUNT(*), MAX(received) FROM records GROUP BY run_id ORDER BY MAX(received) DESC")]
    finally:
        conn.close()


def load_run(db_path: str | Path, run_id: Optional[str] = None, kind: str = "train") -> tuple[list[dict], list[dict]]:
    """Records (dicts, ordered by attempt then iteration) and alerts (dicts) of one run from a
    sidecar database; ``run_id`` None picks the most recently updated run."""
    if not Path(db_path).is_file():
        raise FileNotFoundError(f"no such database: {db_path}")
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        if run_id is None:
            row = conn.execute("SELECT run_id FROM records GROUP BY run_id ORDER BY MAX(received) DESC LIMIT 1"
                               ).fetchone()
            if row is None:
                return [], []
            run_id = row[0]
        records = [json.loads(d) for (d,) in conn.execute(
            "SELECT data FROM records WHERE run_id = ? AND kind = ? ORDER BY attempt, iteration", (run_id, kind))]
        alerts = [json.loads(d) for (d,) in conn.execute(
            "SELECT data FROM alerts WHERE run_id = ? ORDER BY id", (run_id,))]
        return records, alerts
    finally:
        conn.close()
