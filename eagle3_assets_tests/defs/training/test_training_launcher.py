"""The training launcher, offline: the pod dagster-k8s would create for eagle3_drafter, built by
dagster-k8s's own `build_pod_body` from exactly what the launcher hands PipesK8sClient.run,
and the environment variables that choose and configure it."""

import pytest
from dagster_k8s.pipes import build_pod_body

from eagle3_assets.definitions import resources_from_env
from eagle3_assets.defs.training.resources import TrainingLauncher
from eagle3_assets.lib.training.k8s_pod import training_pod_spec
from eagle3_assets.lib.training.torchrun import torchrun_command

ENV = {
    "EAGLE3_TRAINING_LAUNCHER": "k8s",
    "EAGLE3_K8S_IMAGE": "registry.example/eagle3-assets:1.2.3-cu128",
    "EAGLE3_K8S_NAMESPACE": "llm",
    "EAGLE3_K8S_DATA_CLAIM": "eagle3-data",
    "EAGLE3_K8S_SECRET": "eagle3-secrets",
    "EAGLE3_K8S_SHM_GI": "128",
    "EAGLE3_K8S_SUBDOMAIN": "eagle3-train",
    "EAGLE3_TRAIN_NPROC": "8",
    "EAGLE3_TRAIN_NNODES": "2",
    "EAGLE3_TRAIN_RDZV_ENDPOINT": "eagle3-train-node-0.eagle3-train:29500",
    "EAGLE3_DATA_ROOT": "/data",
}
PIPES_BOOTSTRAP = {"DAGSTER_PIPES_CONTEXT": "ctx", "DAGSTER_PIPES_MESSAGES": "msgs"}


def pod_for(env: dict[str, str]):
    resources = resources_from_env(env)
    launcher, training = resources["training_launcher"], resources["training"]
    command = torchrun_command(
        ["-m", "eagle3_assets.training_entry", "/data/drafter/runs/k/run.json"],
        training.nproc,
        training.nnodes,
        training.rdzv_endpoint,
    )
    args = launcher.k8s_run_args(command, training.nproc, "/data", "/app")
    pod = build_pod_body(
        pod_name="dagster-run-eagle3-drafter",
        image=None,
        command=args["command"],
        env_vars=PIPES_BOOTSTRAP,
        base_pod_meta=args["base_pod_meta"],
        base_pod_spec=args["base_pod_spec"],
    )
    return launcher, args, command, pod


def test_the_pod_holds_the_nodes_gpus_the_image_and_the_same_command():
    launcher, args, command, pod = pod_for(ENV)
    assert launcher.kind == "k8s" and args["namespace"] == "llm"
    (container,) = pod.spec.containers
    assert container.image == "registry.example/eagle3-assets:1.2.3-cu128"
    assert container.command == command
    assert command[3:7] == [
        "--nnodes=2",
        "--node-rank=0",
        "--rdzv-backend=static",
        "--rdzv-endpoint=eagle3-train-node-0.eagle3-train:29500",
    ]
    assert container.resources.limits == {"nvidia.com/gpu": "8"}
    assert container.resources.requests == {"nvidia.com/gpu": "8"}
    assert container.working_dir == "/app"
    assert pod.spec.restart_policy == "Never"
    # node 0 answers at <hostname>.<subdomain>: the rendezvous endpoint the other nodes dial
    assert (pod.spec.hostname, pod.spec.subdomain) == ("eagle3-train-node-0", "eagle3-train")
    assert pod.metadata.labels["eagle3/node-rank"] == "0"
    assert pod.metadata.labels["app.kubernetes.io/name"] == "eagle3-training"


def test_the_data_volume_and_shared_memory_are_mounted():
    _, _, _, pod = pod_for(ENV)
    (container,) = pod.spec.containers
    mounts = {m.name: m.mount_path for m in container.volume_mounts}
    assert mounts == {"data": "/data", "shm": "/dev/shm"}
    volumes = {v.name: v for v in pod.spec.volumes}
    assert volumes["data"].persistent_volume_claim.claim_name == "eagle3-data"
    assert (volumes["shm"].empty_dir.medium, volumes["shm"].empty_dir.size_limit) == (
        "Memory",
        "128Gi",
    )


def test_secrets_arrive_by_reference_and_never_as_values(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value_never_in_a_spec")
    monkeypatch.setenv("VLLM_API_KEY", "vllm_secret_value_never_in_a_spec")
    _, _, _, pod = pod_for({**ENV, "HF_TOKEN": "hf_secret_value_never_in_a_spec"})
    (container,) = pod.spec.containers
    env = {e.name: e.value for e in container.env}
    assert env == {"PYTHONUNBUFFERED": "1", **PIPES_BOOTSTRAP}
    (env_from,) = container.env_from
    assert env_from.secret_ref.name == "eagle3-secrets"
    assert "_secret_value_never_in_a_spec" not in str(pod.to_dict())


def test_without_a_secret_there_is_no_env_from():
    _, _, _, pod = pod_for({k: v for k, v in ENV.items() if k != "EAGLE3_K8S_SECRET"})
    assert pod.spec.containers[0].env_from is None


def test_the_default_launcher_is_a_local_subprocess_on_one_node():
    resources = resources_from_env({})
    assert resources["training_launcher"].kind == "subprocess"
    assert (resources["training"].nnodes, resources["training"].rdzv_endpoint) == (1, None)


@pytest.mark.parametrize(
    ("launcher", "message"),
    [
        (TrainingLauncher(kind="k8s", data_claim="c"), "needs an image and a data volume claim"),
        (TrainingLauncher(kind="k8s", image="i"), "needs an image and a data volume claim"),
    ],
)
def test_a_k8s_launcher_without_image_or_volume_is_refused(launcher, message):
    with pytest.raises(ValueError, match=message):
        launcher.k8s_run_args(["python"], 1, "/data", "/app")


def test_an_unknown_launcher_is_refused_by_name_at_load():
    with pytest.raises(
        ValueError, match="EAGLE3_TRAINING_LAUNCHER: expected 'subprocess' or 'k8s', found 'slurm'"
    ):
        resources_from_env({"EAGLE3_TRAINING_LAUNCHER": "slurm"})


def test_a_relative_data_root_cannot_be_mounted():
    with pytest.raises(ValueError, match="absolute path in the pod, found 'data'"):
        training_pod_spec("image", 1, "data", "claim", "/app")
