"""GCS permissions and Workload Identity principals.

Which role grants a permission, whom to grant it to, and which permission a GCS 403 names: shared by the
preflight and the trainer's bucket check.
"""

from __future__ import annotations

import re

from jaxrec.adapters.store import split_gcs_url
from jaxrec.model.config import JobConfig

# The role that grants each storage permission the run needs on its bucket (GCS IAM roles:
# roles/storage.objectUser has storage.objects.*, not storage.buckets.get; roles/storage.legacyBucketReader
# has storage.buckets.get and storage.objects.list).
ROLE_FOR_PERMISSION = {
    "storage.buckets.get": "roles/storage.legacyBucketReader",
    "storage.objects.create": "roles/storage.objectUser",
    "storage.objects.get": "roles/storage.objectUser",
    "storage.objects.delete": "roles/storage.objectUser",
    "storage.objects.list": "roles/storage.objectUser",
}
# GCS 403 bodies name the permission: "... does not have storage.buckets.get access to ..." and
# "Permission 'storage.buckets.get' denied on resource (or it may not exist)."
_PERMISSION_IN_MESSAGE = re.compile(r"(?:Permission '|does not have )(storage\.[a-zA-Z.]+)")


def workload_principal(cfg: JobConfig, service_account: str) -> str:
    """The Workload Identity principal of a Kubernetes ServiceAccount (GKE docs "Workload Identity Federation").

    ``PROJECT_NUMBER`` and ``PROJECT`` are left for the user: nothing in the config names the project.
    """
    return (
        "principal://iam.googleapis.com/projects/PROJECT_NUMBER/locations/global/workloadIdentityPools/"
        f"PROJECT.svc.id.goog/subject/ns/{cfg.namespace}/sa/{service_account}"
    )


def grant_command(cfg: JobConfig, permission: str) -> str:
    """The gcloud command that grants ``permission`` on the run's bucket to the steps' and workers' identities."""
    bucket, _ = split_gcs_url(cfg.storage.root)
    role = ROLE_FOR_PERMISSION.get(permission, "roles/storage.objectUser")
    return (
        f"gcloud storage buckets add-iam-policy-binding gs://{bucket} --role={role} "
        f"--member={workload_principal(cfg, cfg.service_account)}"
    )


def permission_from_403(message: str, default: str) -> str:
    """The permission a GCS 403 message names (``default`` when it names none)."""
    m = _PERMISSION_IN_MESSAGE.search(message or "")
    return m.group(1).rstrip(".") if m else default
