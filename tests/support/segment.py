"""The JobSet a generated Workflow's train-segment step creates, rendered as the step renders it.

The Workflow carries no manifest: train-segment renders it (``model.jobset.jobset_manifest``) from the config
validate-config pins (the Workflow's ``config`` artifact, stored as ``config.json``) and the attempt's parameters
its arguments carry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import yaml

from jaxrec.model.config import JobConfig, parse_config
from jaxrec.model.jobset import JobSetParams, jobset_manifest
from recovery_steps import train_segment as ts

# The train-segment arguments the JobSet is rendered from, by the JobSetParams field each fills.
PARAM_FLAGS = {
    "name": "--jobset-name",
    "run_id": "--run-id",
    "store_root": "--store-root",
    "attempt": "--attempt",
    "restore_step": "--restore-step",
    "coordinator_port": "--coordinator-port",
    "metrics_port": "--metrics-port",
}


def template(wf: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The Workflow's template ``name``."""
    (tpl,) = [t for t in wf["spec"]["templates"] if t["name"] == name]
    return tpl


def pinned_config(wf: Mapping[str, Any], run_id: str | None = None) -> JobConfig:
    """The config validate-config pins for ``wf``: its ``config`` artifact, with the run id it is given, as
    ``config.json`` holds it (``model_dump`` read back by ``parse_config``)."""
    (art,) = [a for a in template(wf, "validate-config")["inputs"]["artifacts"] if a["name"] == "config"]
    cfg = parse_config(yaml.safe_load(art["raw"]["data"]), "the Workflow's config artifact")
    if run_id is not None:
        cfg = cfg.model_copy(update={"run_id": run_id})
    return parse_config(cfg.model_dump(mode="json"), "config.json")


def segment_argv(wf: Mapping[str, Any], substitute: Callable[[str], str] | None = None) -> list[str]:
    """The train-segment arguments the JobSet is rendered from (``substitute``: what Argo makes of each value)."""
    args = template(wf, "train-segment")["container"]["args"]
    out: list[str] = []
    for flag in PARAM_FLAGS.values():
        value = args[args.index(flag) + 1]
        out += [flag, substitute(value) if substitute else value]
    return out


def segment_jobset(wf: Mapping[str, Any], substitute: Callable[[str], str] | None = None) -> dict[str, Any]:
    """The JobSet train-segment creates for ``wf``.

    With ``substitute`` (Argo's values for the placeholders) the arguments go through the step's own parser and
    rendering (``train_segment.segment_params``, ``segment_manifest``); without it the JobSet keeps the Argo
    placeholders the arguments carry (the wiring of the template's inputs to the JobSet's fields).
    """
    argv = segment_argv(wf, substitute)
    if substitute is None:
        values = dict(zip(argv[::2], argv[1::2], strict=True))
        params = JobSetParams(**{field: values[flag] for field, flag in PARAM_FLAGS.items()})
        return jobset_manifest(pinned_config(wf), params)
    args = ts.parser().parse_args(argv)
    cfg = pinned_config(wf, args.run_id)
    return ts.segment_manifest(cfg, ts.segment_params(args), "config.json")
