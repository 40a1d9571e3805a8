"""The Kubernetes pod that runs drafter training (node 0 of the torchrun job), as plain dicts in
the API's camelCase: what dagster-k8s's PipesK8sClient takes as base_pod_meta/base_pod_spec.

The pod sees the data volume at the same absolute path as the Dagster run, and starts in the
same working directory, so every path in run.json means the same file in both. Secrets reach
it only as references to a Kubernetes Secret (envFrom), never as values in the spec.
"""

from __future__ import annotations

from pathlib import PurePosixPath

TRAINING_LABELS = {"app.kubernetes.io/name": "eagle3-training", "eagle3/node-rank": "0"}
NODE0_HOSTNAME = "eagle3-train-node-0"


def training_pod_spec(
    image: str,
    gpus: int,
    data_root: str,
    data_claim: str,
    working_dir: str,
    secret_name: str | None = None,
    shm_gi: int = 64,
    subdomain: str | None = None,
) -> dict:
    """One container holding `gpus` GPUs (torchrun's ranks on this node).

    `data_claim`: the PersistentVolumeClaim holding `data_root` (ReadWriteMany when other
    pods share it). `secret_name`: a Secret whose keys become environment variables (HF_TOKEN,
    ...). `shm_gi`: /dev/shm size (torch workers and NCCL share memory there; the container
    default is 64 MiB). `subdomain`: a headless Service selecting TRAINING_LABELS; node 0 is then
    reachable at `eagle3-train-node-0.<subdomain>`, the rendezvous host other nodes dial.
    """
    if not PurePosixPath(data_root).is_absolute():
        raise ValueError(f"data root must be an absolute path in the pod, found {data_root!r}")
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, found {gpus}")
    container: dict = {
        "name": "torchrun",
        "image": image,
        "workingDir": working_dir,
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],  # step logs stream as they happen
        "resources": {
            "limits": {"nvidia.com/gpu": str(gpus)},
            "requests": {"nvidia.com/gpu": str(gpus)},
        },
        "volumeMounts": [
            {"name": "data", "mountPath": data_root},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    if secret_name:
        container["envFrom"] = [{"secretRef": {"name": secret_name}}]
    spec: dict = {
        "restartPolicy": "Never",  # a failed attempt is retried by re-materializing (resumes)
        "containers": [container],
        "volumes": [
            {"name": "data", "persistentVolumeClaim": {"claimName": data_claim}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gi}Gi"}},
        ],
    }
    if subdomain:
        spec |= {"hostname": NODE0_HOSTNAME, "subdomain": subdomain}
    return spec
