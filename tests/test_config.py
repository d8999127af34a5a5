"""The config tree: TPU table, derived hosts, defaults, hashing, and one message per problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from jaxrec.model.config import ConfigError, JobConfig, load_config, parse_config
from jaxrec.model.contract import FailureClass
from jaxrec.model.tpu import TPU_TYPES

ROOT = Path(__file__).resolve().parents[1]
BASE = {
    "run_id": "r1",
    "image": "img:1",
    "slice": {"accelerator": "v5e", "topology": "4x4"},
    "storage": {"root": "gs://bucket-1/prefix"},
}


def with_(path: str, value):
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    *parents, leaf = path.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return data


@pytest.mark.parametrize("path", sorted(ROOT.glob("configs/*.yaml")), ids=lambda p: p.name)
def test_every_example_config_parses(path):
    cfg = load_config(path)
    # Every example is a gang of several hosts but the TPU machine's: one program at a time holds its chip.
    assert cfg.slice.num_hosts >= 2 or cfg.slice.local_devices == "accelerator"
    assert cfg.data.global_batch_size % (cfg.slice.num_hosts * cfg.slice.devices_per_process) == 0


def test_example_shapes_match_their_names():
    hosts = {p.stem: load_config(p).slice.num_hosts for p in ROOT.glob("configs/*.yaml")}
    assert hosts["local-cpu"] == 4
    assert hosts["v5e-4x4"] == 4
    assert hosts["v5p-64"] == 16
    assert load_config(ROOT / "configs/v6e-8x8.yaml").slice.accelerator == "v6e"
    assert hosts["local-tpu"] == 1


@pytest.mark.parametrize(
    ("acc", "topology", "hosts"),
    [
        ("v5e", "4x4", 4),
        ("v5e", "16x16", 64),
        ("v5p", "2x2x2", 2),
        ("v5p", "4x4x4", 16),
        ("v6e", "8x8", 16),
        ("v4", "2x2x4", 4),
        ("tpu7x", "2x4x4", 8),
    ],
)
def test_hosts_are_derived_from_the_tpu_table(acc, topology, hosts):
    data = with_("slice", {"accelerator": acc, "topology": topology})
    data["data"] = {"global_batch_size": 4 * hosts * 4}
    cfg = parse_config(data)
    assert cfg.slice.num_hosts == hosts
    assert cfg.slice.devices_per_process == TPU_TYPES[acc].chips_per_vm


def test_every_tpu_type_has_labels_and_only_multi_host_topologies_spanning_hosts():
    for t in TPU_TYPES.values():
        assert t.gke_accelerator and t.machine_type and t.chips_per_vm == 4
        assert all(t.hosts(top) >= 2 for top in t.multi_host_topologies), t.name
        # One VM holds a single-host topology whole: its chips are the topology's.
        assert all(t.hosts(top) == 1 and t.vm(top).chips == t.chips(top) for top in t.single_host_topologies), t.name


@pytest.mark.parametrize(
    ("acc", "topology", "machine", "chips", "cpu", "memory"),
    [
        ("v5e", "1x1", "ct5lp-hightpu-1t", 1, "19", "38Gi"),
        ("v5e", "2x2", "ct5lp-hightpu-4t", 4, "89", "153Gi"),
        ("v5e", "2x4", "ct5lp-hightpu-8t", 8, "179", "307Gi"),
        ("v6e", "1x1", "ct6e-standard-1t", 1, "35", "140Gi"),
        ("v4", "2x2x1", "ct4p-hightpu-4t", 4, "192", "325Gi"),
    ],
)
def test_a_single_host_topology_is_a_gang_of_one_on_its_own_machine(acc, topology, machine, chips, cpu, memory):
    """One VM holds the topology: one process, the VM's chips, requests from that machine type's size."""
    from jaxrec.model.jobset import JobSetParams, jobset_manifest

    data = with_("slice", {"accelerator": acc, "topology": topology})
    data["data"] = {"global_batch_size": 4 * chips}
    cfg = parse_config(data)
    assert (cfg.slice.num_hosts, cfg.slice.devices_per_process) == (1, chips)
    assert TPU_TYPES[acc].vm(topology).name == machine
    assert cfg.slice.worker_requests() == {"cpu": cpu, "memory": memory}
    params = JobSetParams("r-a0", cfg.run_id, cfg.storage.root, "0", "-1", "8476", "9431")
    job = jobset_manifest(cfg, params)["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 1
    (trainer,) = job["template"]["spec"]["containers"]
    assert trainer["resources"]["limits"]["google.com/tpu"] == chips


@pytest.mark.parametrize(
    ("data", "needles"),
    [
        (with_("slice", {"accelerator": "v9"}), ["slice.accelerator", "'v9'", "v5e", "local"]),
        (with_("slice", {"accelerator": "v5e", "topology": "3x3"}), ["slice.topology", "'3x3'", "4x4"]),
        (with_("slice", {"accelerator": "v6e", "topology": "2x2x1"}), ["'2x2x1'", "single-host: 1x1, 2x2", "8x8"]),
        (with_("slice", {"accelerator": "v5e", "topology": "4x4", "hosts": 3}), ["slice.hosts", "3", "hosts: 4"]),
        (with_("retry", {"budgets": {"hang": -1}}), ["retry.budgets.hang", "-1", "greater than or equal to 0"]),
        (with_("retry", {"budgets": {"flaky": 2}}), ["retry.budgets", "flaky", "preemption"]),
        (with_("storage", {"root": "gs://"}), ["storage.root", "gs://BUCKET"]),
        (with_("storage", {"root": "s3://b/p"}), ["storage.root", "s3://b/p"]),
        (with_("checkpoint", {"intervl_steps": 5}), ["checkpoint.intervl_steps", "unknown key", "interval_steps"]),
        ({k: v for k, v in BASE.items() if k != "image"}, ["image", "required"]),
        (with_("slice", {"accelerator": "local"}), ["slice.hosts", "required"]),
        (with_("model", {"d_model": 30, "n_heads": 4}), ["model.n_heads", "d_model"]),
        (with_("data", {"global_batch_size": 6}), ["data.global_batch_size", "16 devices"]),
        (with_("run_id", "Bad_Run"), ["run_id", "'Bad_Run'", "lowercase"]),
    ],
)
def test_bad_configs_get_one_clear_message_per_problem(data, needles):
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    text = err.value.render()
    for needle in needles:
        assert needle in text, (needle, text)
    assert "Traceback" not in text


def test_several_problems_are_all_reported():
    data = with_("storage", {"root": "gs://X"})
    data["bogus"] = 1
    data["retry"] = {"budgets": {"application": -2}}
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert len(err.value.problems) == 3, err.value.problems


def test_yaml_syntax_error_names_the_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("run_id: r1\nslice:\n  accelerator: [v5e\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert "YAML syntax error at line" in err.value.render()


def test_config_is_frozen_and_hash_is_stable_and_sensitive():
    a = parse_config(BASE)
    assert a.config_hash() == parse_config(dict(BASE)).config_hash()
    assert a.config_hash() != parse_config(with_("checkpoint", {"interval_steps": 7})).config_hash()
    with pytest.raises(ValidationError):
        a.run_id = "other"  # type: ignore[misc]


def test_budgets_keep_defaults_for_classes_left_out():
    cfg = parse_config(with_("retry", {"budgets": {"preemption": 99}}))
    assert cfg.retry.budget(FailureClass.PREEMPTION) == 99
    assert cfg.retry.budget(FailureClass.CONFIGURATION) == 0
    assert set(cfg.retry.budgets) == set(FailureClass)


def test_every_field_is_described():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, JobConfig.__mro__[1]) and ann is not model:
                walk(ann)

    walk(JobConfig)


@pytest.mark.parametrize("name", ["v5e-4x4.yaml", "v5p-64.yaml", "v6e-8x8.yaml"])
def test_tpu_configs_get_timeouts_a_long_compile_cannot_trip(name):
    from jaxrec.model.config import TPU_TIMEOUT_DEFAULTS

    t = load_config(ROOT / "configs" / name).training
    assert t.heartbeat_timeout_s == TPU_TIMEOUT_DEFAULTS["heartbeat_timeout_s"] >= 1200 > 100  # JAX's default: 100
    assert t.init_timeout_s == TPU_TIMEOUT_DEFAULTS["init_timeout_s"]


def test_local_rehearsals_keep_short_timeouts_and_explicit_values_win():
    local = load_config(ROOT / "configs" / "local-cpu.yaml").training
    assert local.heartbeat_timeout_s <= 10 and local.init_timeout_s <= 120
    data = yaml.safe_load((ROOT / "configs" / "v5e-4x4.yaml").read_text())
    data["training"]["heartbeat_timeout_s"] = 300
    t = parse_config(data).training
    assert t.heartbeat_timeout_s == 300 and t.init_timeout_s == 1800
    data["training"] = {"total_steps": data["training"]["total_steps"]}
    assert parse_config(data).training.heartbeat_timeout_s == 1200


# ---- run ids and the worker pod names JobSet admits ------------------------------------------------


def _webhooks_longest_pod_name(manifest: dict) -> str:
    """The name jobset v0.12.0's webhook checks: GenPodName(js, rjob, replicas-1, completions-1) + "-abcde"."""
    rj = manifest["spec"]["replicatedJobs"][0]
    last_pod = rj["template"]["spec"]["completions"] - 1
    return f"{manifest['metadata']['name']}-{rj['name']}-{rj['replicas'] - 1}-{last_pod}-abcde"


@pytest.mark.parametrize("name", ["local-cpu.yaml", "v5e-4x4.yaml", "v5p-64.yaml", "v6e-8x8.yaml"])
def test_longest_pod_name_is_the_one_the_webhook_checks_in_the_manifest(name):
    from jaxrec.model.jobset import JobSetParams, jobset_manifest
    from jaxrec.model.names import jobset_name, longest_pod_name

    cfg = load_config(ROOT / "configs" / name)
    manifest = jobset_manifest(
        cfg,
        JobSetParams(
            name=jobset_name(cfg.run_id, 99999),
            run_id=cfg.run_id,
            store_root="gs://b/p",
            attempt="99999",
            restore_step="-1",
            coordinator_port="1",
            metrics_port="2",
        ),
    )
    assert _webhooks_longest_pod_name(manifest) == longest_pod_name(cfg.run_id, 99999, cfg.slice.num_hosts)


def test_largest_attempt_follows_the_retry_policy():
    from jaxrec.model.config import ATTEMPT_CEILING, largest_attempt

    def retry(**kw):
        return parse_config(with_("retry", kw)).retry

    assert largest_attempt(retry()) == ATTEMPT_CEILING == 99_999  # preemption and capacity: since_progress
    assert largest_attempt(retry(max_attempts=10)) == 9  # decide() stops after attempt max_attempts - 1
    assert largest_attempt(retry(max_attempts=10**9)) == ATTEMPT_CEILING
    every_run = {c.value: "run" for c in FailureClass}
    budgets = {c.value: 0 for c in FailureClass} | {"preemption": 3, "capacity": 2, "infrastructure": 1}
    assert largest_attempt(retry(budget_scopes=every_run, budgets=budgets)) == 6
    assert largest_attempt(retry(budget_scopes=every_run, budgets=budgets, max_attempts=4)) == 3
    # A resubmitted run continues the numbering: its first attempt is reached whatever the policy says.
    assert largest_attempt(retry(max_attempts=10), first_attempt=12) == 12


@pytest.mark.parametrize(
    ("slice_", "retry", "longest"),
    [
        ({"accelerator": "v5e", "topology": "4x4"}, {}, 38),  # 4 hosts, attempt 99999
        ({"accelerator": "local", "hosts": 4}, {}, 38),  # rehearsed locally as on the cluster
        ({"accelerator": "v5p", "topology": "4x4x4"}, {}, 37),  # 16 hosts: two-digit pod index
        ({"accelerator": "v5e", "topology": "4x4"}, {"max_attempts": 1000}, 40),  # attempt 999
        ({"accelerator": "v5p", "topology": "4x4x4"}, {"max_attempts": 1000}, 39),
        ({"accelerator": "v5p", "topology": "4x4x4"}, {"max_attempts": 100}, 40),
        ({"accelerator": "v5e", "topology": "4x4"}, {"budget_scopes": {c.value: "run" for c in FailureClass}}, 40),
    ],
)
def test_run_id_is_checked_against_the_pod_names_of_the_highest_attempt(slice_, retry, longest):
    from jaxrec.model.config import largest_attempt, longest_run_id, run_id_pod_name_problem
    from jaxrec.model.names import POD_NAME_MAX, longest_pod_name

    def cfg(run_id):
        data = {**BASE, "run_id": run_id, "slice": slice_, "retry": retry, "data": {"global_batch_size": 64}}
        return parse_config(data)

    fits = cfg("r" * longest)
    attempt = largest_attempt(fits.retry)
    assert longest_run_id(fits.slice.num_hosts, attempt) == longest
    assert run_id_pod_name_problem(fits) is None
    assert len(longest_pod_name(fits.run_id, attempt, fits.slice.num_hosts)) <= POD_NAME_MAX
    if longest == 40:
        return  # the run-id syntax is the limit here
    problem = run_id_pod_name_problem(cfg("r" * (longest + 1)))
    assert problem is not None and "\n" not in problem and len(problem) <= 300
    assert problem.startswith("run_id: ") and f"at most {longest} characters" in problem
    assert f"at attempt {attempt}" in problem and "JobSet admits 63" in problem


def test_the_fix_names_the_attempt_cap_that_would_do():
    from jaxrec.model.config import run_id_pod_name_problem

    problem = run_id_pod_name_problem(parse_config({**BASE, "run_id": "r" * 40}))
    assert problem is not None and "retry.max_attempts to at most 1000" in problem
    assert run_id_pod_name_problem(parse_config({**BASE, "run_id": "r" * 40, "retry": {"max_attempts": 1000}})) is None


@pytest.mark.parametrize("name", ["local-cpu.yaml", "local-image-classifier.yaml", "v5p-64.yaml"])
@pytest.mark.parametrize("reference", [False, True])
def test_local_runner_run_ids_stay_within_the_limits(name, reference):
    import time

    from jaxrec.model.config import largest_attempt, longest_run_id, run_id_pod_name_problem, run_id_problem
    from workflows.local.runner import REFERENCE_SUFFIX, run_id_problems, stamped_run_id

    cfg = load_config(ROOT / "configs" / name)
    stamp = "-19700101-000000"
    for base in (cfg.run_id, "b" * 40, "b" * 30 + "-" + "c" * 9):
        run_id = stamped_run_id(base, cfg, reference=reference, at=time.gmtime(0))
        assert run_id.endswith(stamp) and base.startswith(run_id.removesuffix(stamp))
        for rid in [run_id, run_id + REFERENCE_SUFFIX] if reference else [run_id]:
            assert run_id_problem(rid) is None
            assert run_id_pod_name_problem(cfg.model_copy(update={"run_id": rid})) is None
        assert run_id_problems(cfg, run_id, reference=reference) == []
    # The shipped configs keep their whole run id, except where the reference run's suffix needs the room.
    shortened = stamped_run_id(cfg.run_id, cfg, reference=reference, at=time.gmtime(0)) != cfg.run_id + stamp
    longest = longest_run_id(cfg.slice.num_hosts, largest_attempt(cfg.retry))
    assert shortened == (len(cfg.run_id + stamp + (REFERENCE_SUFFIX if reference else "")) > longest)


@pytest.mark.parametrize("path", sorted(ROOT.glob("configs/*.yaml")), ids=lambda p: p.name)
def test_every_config_survives_its_stored_form(path):
    # config.json holds every field, defaults included: a rule about fields "given" must still accept it.
    cfg = load_config(path)
    assert parse_config(cfg.model_dump(mode="json")).config_hash() == cfg.config_hash()
