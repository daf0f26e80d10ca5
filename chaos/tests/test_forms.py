"""The chaos forms run what they claim: the long form (``make chaos``) and the short forms (CI)
have keyed jobs and the freeze inside a transaction among their faults, and a trigger plan sends
what it was asked to (no services)."""

from __future__ import annotations

import random
import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from chaos import fault as F
from chaos import trigger as T
from chaos.driver import build_parser, config_of, group_of_id
from tests.chaos.test_chaos import POSTGRES_ISOLATION, POSTGRES_KINDS, SHORT, SQLITE_KINDS

MAKEFILE = Path(__file__).resolve().parents[2] / "Makefile"


def long_form_arguments() -> list[str]:
    """The driver's arguments in the Makefile's ``CHAOS_ARGS`` (continuation lines joined)."""
    text = MAKEFILE.read_text().replace("\\\n", " ")
    found = re.search(r"^CHAOS_ARGS \?=(.*)$", text, re.MULTILINE)
    assert found, "no CHAOS_ARGS in the Makefile"
    return shlex.split(found.group(1))


def test_the_long_form_freezes_workers_inside_transactions_and_sends_keyed_triggers() -> None:
    config = config_of(build_parser().parse_args(long_form_arguments()))

    assert "freeze_in_transaction" in config.kinds
    assert {"kill_child", "kill_worker", "freeze", "sigterm"} <= set(config.kinds)
    assert config.keyed and config.keys >= 2 and config.triggers >= 100
    assert config.debounced_keys >= 1 and config.newest_keys >= 1


def test_the_long_form_without_service_restarts_keeps_every_other_fault() -> None:
    # As it runs on a machine whose PostgreSQL and Redis others use
    arguments = [a for a in long_form_arguments() if not a.startswith("--restart-")]

    config = config_of(build_parser().parse_args(arguments))

    assert "restart_database" not in config.kinds and "restart_broker" not in config.kinds
    assert {"freeze_in_transaction", "revoke", "cancel"} <= set(config.kinds)


def test_the_short_forms_have_keyed_jobs_and_the_postgresql_one_freezes_in_transactions() -> None:
    assert SHORT.keyed and SHORT.triggers > SHORT.keys
    assert "freeze_in_transaction" in POSTGRES_KINDS


def test_a_trigger_plan_sends_every_trigger_asked_for_in_bursts_no_larger_than_asked() -> None:
    bursts = T.plan(random.Random(7), triggers=40, keys=3, largest=5, gap=0.5)

    assert sum(b.size for b in bursts) == 40
    assert all(1 <= b.size <= 5 and all(0 <= g <= 0.5 for g in b.gaps) for b in bursts)
    assert {b.account for b in bursts} == {0, 1, 2}
    assert [b.at for b in bursts] == sorted(b.at for b in bursts)
    assert all(0.03 <= b.at <= 0.92 for b in bursts)
    # and a seed replays the same plan
    assert T.plan(random.Random(7), triggers=40, keys=3, largest=5, gap=0.5) == bursts


def test_the_long_form_has_every_edge_of_issue_23() -> None:
    # Soft time limits inside statements, dying clients, keyed controls and expiring triggers,
    # transactional checkpoints at repeatable read (the long form runs on PostgreSQL)
    config = config_of(build_parser().parse_args(long_form_arguments()))

    assert config.soft_limited_jobs >= 20
    assert {"kill_client", "revoke_keyed", "cancel_keyed"} <= set(config.kinds)
    assert config.key_expiring > 0
    assert config.isolation in ("repeatable_read", "mixed")
    assert not config.namespace_reaper  # SQLite only


def test_each_edge_can_be_left_out() -> None:
    arguments = [
        *long_form_arguments(),
        "--soft-limits",
        "0",
        "--no-dying-clients",
        "--no-keyed-controls",
        "--isolation",
        "read_committed",
    ]
    config = config_of(build_parser().parse_args(arguments))

    assert config.soft_limited_jobs == 0 and config.key_expiring == 0
    assert not {"kill_client", "revoke_keyed", "cancel_keyed"} & set(config.kinds)
    assert config.isolation == "read_committed"


def test_the_long_form_on_sqlite_runs_a_reaper_in_another_pid_namespace_where_it_can() -> None:
    arguments = ["--database", "sqlite", "--broker", "filesystem"]
    config = config_of(build_parser().parse_args(arguments))

    assert config.isolation is None  # SQLite: no isolation levels
    assert "revoke_keyed" not in config.kinds and "cancel_keyed" in config.kinds
    if F.unshare_error() is not None:
        pytest.skip(f"unshare cannot run here: {F.unshare_error()}")
    assert config.namespace_reaper
    assert not config_of(
        build_parser().parse_args([*arguments, "--no-namespace-reaper"])
    ).namespace_reaper
    with pytest.raises(SystemExit, match="SQLite only"):
        config_of(build_parser().parse_args(["--namespace-reaper"]))


def test_the_short_forms_have_the_cheap_edges_of_issue_23() -> None:
    assert SHORT.soft_limited_jobs >= 1 and SHORT.key_expiring > 0
    assert {"kill_client", "revoke_keyed", "cancel_keyed"} <= set(POSTGRES_KINDS)
    assert {"kill_client", "cancel_keyed"} <= set(SQLITE_KINDS)
    assert POSTGRES_ISOLATION in ("repeatable_read", "mixed")


def failover_form(faults: int) -> list[str]:
    """The medium failover run of docs/contributing.md, with ``faults`` faults."""
    return [
        "--jobs", "150", "--units", "10", "--unit-seconds", "0.3", "--faults", str(faults),
        "--keys", "3", "--triggers", "60", "--key-units", "8",
        "--broker", "redis", "--database", F.FAILOVER_DATABASE, "--failover",
    ]  # fmt: skip


def test_the_failover_form_adds_failovers_to_every_other_fault() -> None:
    config = config_of(build_parser().parse_args(failover_form(50)))

    assert "failover" in config.kinds and "failover" in F.SERVICE_KINDS
    assert {"freeze_in_transaction", "kill_worker", "revoke", "kill_client"} <= set(config.kinds)
    assert "restart_database" not in config.kinds


def test_failovers_are_capped_and_land_mid_run_as_service_restarts() -> None:
    kinds = config_of(build_parser().parse_args(failover_form(50))).kinds

    for seed in range(20):
        plan = F.plan(random.Random(seed), count=50, kinds=kinds, lease_seconds=3.0)
        failovers = [f for f in plan if f.kind == "failover"]

        assert 1 <= len(failovers) <= 50 // F.FAULTS_PER_SERVICE_RESTART
        assert all(0.15 <= f.at <= 0.75 for f in failovers)


def test_failover_faults_need_the_private_pair_and_no_restart_of_the_shared_server() -> None:
    from chaos.driver import check_restartable

    def problems(arguments: list[str]) -> list[str]:
        args = build_parser().parse_args(arguments)
        return check_restartable(
            config_of(args), database_url=args.database, broker="none", database=args.database
        )

    assert problems(failover_form(30)) == []
    assert problems(["--failover"]) == [
        f"--failover needs --database {F.FAILOVER_DATABASE} (a primary and standby of the "
        "run's own: the shared PostgreSQL is never failed over)"
    ]
    refused = problems([*failover_form(30), "--restart-database"])
    assert refused and refused[0].startswith("--restart-database needs the local PostgreSQL")


def test_a_machine_without_postgresql_server_binaries_refuses_the_failover_database(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from chaos.driver import start_failover_pair
    from tests.support import replica

    monkeypatch.setattr(replica, "find_bindir", lambda: None)

    refused = start_failover_pair()

    assert isinstance(refused, str)
    assert refused.startswith(
        f"--database {F.FAILOVER_DATABASE}: cannot run a private PostgreSQL primary and "
        "synchronous standby here"
    )
    assert (
        "PostgreSQL server binaries (initdb, pg_ctl, pg_basebackup, postgres) not found" in refused
    )


def test_debounced_and_newest_accounts_come_after_the_coalescing_ones_and_default_to_none() -> None:
    parser = build_parser()
    assert (config_of(parser.parse_args([])).debounced_keys, SHORT.newest_keys) == (0, 0)

    config = config_of(
        parser.parse_args(["--keys", "2", "--debounced-keys", "1", "--newest-keys", "2"])
    )

    assert config.all_keys == 5
    assert [config.account(n)[1] for n in range(5)] == [
        "account:k0",
        "account:k1",
        "account:d0",
        "account:n0",
        "account:n1",
    ]
    bursts = T.plan(random.Random(3), triggers=60, keys=config.all_keys, largest=4, gap=0.5)
    assert {b.account for b in bursts} == set(range(5))


def test_grouped_jobs_are_exactly_once_jobs_of_the_long_form_named_by_their_group() -> None:
    assert config_of(build_parser().parse_args([])).grouped_jobs == SHORT.grouped_jobs == 0
    long_form = config_of(build_parser().parse_args(long_form_arguments()))
    assert long_form.grouped_jobs >= 1
    # Sent by name and retries of rated jobs: in the long form only
    assert long_form.grouped_by_name > 0 and long_form.grouped_retries > 0
    assert SHORT.grouped_by_name == SHORT.grouped_retries == 0

    assert group_of_id("chaos-7-00012-eo-g1") == "g1"
    assert group_of_id("chaos-7-00012-eo-g2-s") == "g2"
    assert group_of_id("chaos-7-00012-eo") is group_of_id("chaos-7-00012-alo-s") is None


def test_a_fault_that_found_no_target_waits_behind_the_faults_already_due_not_before_them() -> None:
    # Given the rest of a plan: faults due at 78% and 80% of the run, one at 90%
    plan = F.plan(random.Random(7), count=4, kinds=F.WORKER_KINDS, lease_seconds=3)
    rest = [replace(f, at=at) for f, at in zip(plan[1:], (0.78, 0.80, 0.90), strict=True)]
    keyed = replace(plan[0], kind="cancel_keyed", at=0.77)

    # When a keyed control due at 77% finds no keyed job to cancel at 81%
    F.try_again(rest, keyed, 0.81)

    # Then the two due faults go first, it tries again before the one not yet due
    assert [f.at for f in rest] == [0.78, 0.80, 0.77, 0.90]
    # and alone due, it is next
    alone = [replace(plan[1], at=0.95)]
    F.try_again(alone, keyed, 0.81)
    assert alone[0] is keyed
