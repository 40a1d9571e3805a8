"""How the drafter is trained, and where its torchrun runs."""

from pathlib import Path
from typing import Literal

import dagster as dg
from pydantic import Field

from eagle3_assets.env_settings import EnvSettings
from eagle3_assets.lib.training.settings import TrainingSettings


class TrainingRecipe(dg.ConfigurableResource, TrainingSettings, EnvSettings):
    """lib/training/settings.py, as a resource."""

    env = {
        "steps": "EAGLE3_TRAIN_STEPS",
        "batch_size": "EAGLE3_TRAIN_BATCH_SIZE",
        "tokens_per_rank": "EAGLE3_TRAIN_TOKENS_PER_RANK",
        "activation_checkpointing": "EAGLE3_TRAIN_ACTIVATION_CHECKPOINTING",
        "export_dtype": "EAGLE3_TRAIN_EXPORT_DTYPE",
        "lr": "EAGLE3_TRAIN_LR",
        "ttt_length": "EAGLE3_TTT_LENGTH",
        "checkpoint_every": "EAGLE3_TRAIN_CHECKPOINT_EVERY",
        "nproc": "EAGLE3_TRAIN_NPROC",
        "nnodes": "EAGLE3_TRAIN_NNODES",
        "rdzv_endpoint": "EAGLE3_TRAIN_RDZV_ENDPOINT",
        "holdout_fraction": "EAGLE3_HOLDOUT_FRACTION",
        "replay_share": "EAGLE3_REPLAY_SHARE",
    }


class TrainingLauncher(dg.ConfigurableResource, EnvSettings):
    """Where the torchrun command runs: a subprocess of the Dagster step (`subprocess`), or a
    Kubernetes pod through dagster-k8s's PipesK8sClient (`k8s`, the `k8s` extra), with the
    node's GPUs in its limits. The command is the same either way; only the launcher differs.
    """

    kind: Literal["subprocess", "k8s"] = "subprocess"
    image: str | None = None  # k8s: the project's image with CUDA torch (same interpreter path)
    namespace: str | None = None  # k8s: else the current namespace
    data_claim: str | None = None  # k8s: the PersistentVolumeClaim holding the data root
    secret_name: str | None = None  # k8s: a Secret exposed to the pod as environment variables
    shm_gi: int = Field(64, ge=1)  # k8s: /dev/shm size
    subdomain: str | None = None  # k8s, several nodes: headless Service that names node 0

    env = {
        "kind": "EAGLE3_TRAINING_LAUNCHER",
        "image": "EAGLE3_K8S_IMAGE",
        "namespace": "EAGLE3_K8S_NAMESPACE",
        "data_claim": "EAGLE3_K8S_DATA_CLAIM",
        "secret_name": "EAGLE3_K8S_SECRET",
        "shm_gi": "EAGLE3_K8S_SHM_GI",
        "subdomain": "EAGLE3_K8S_SUBDOMAIN",
    }

    def k8s_run_args(self, command: list[str], gpus: int, data_root: str, working_dir: str) -> dict:
        """The arguments PipesK8sClient.run gets besides the context: offline, so testable."""
        from eagle3_assets.lib.training.k8s_pod import TRAINING_LABELS, training_pod_spec

        if not (self.image and self.data_claim):
            raise ValueError("the k8s training launcher needs an image and a data volume claim")
        spec = training_pod_spec(
            image=self.image,
            gpus=gpus,
            data_root=data_root,
            data_claim=self.data_claim,
            working_dir=working_dir,
            secret_name=self.secret_name,
            shm_gi=self.shm_gi,
            subdomain=self.subdomain,
        )
        return {
            "command": command,
            "namespace": self.namespace,
            "base_pod_meta": {"labels": TRAINING_LABELS},
            "base_pod_spec": spec,
        }

    def run(
        self,
        context: dg.AssetExecutionContext,
        command: list[str],
        gpus: int,
        data_root: str,
    ) -> dg.PipesClientCompletedInvocation:
        if self.kind == "subprocess":
            return dg.PipesSubprocessClient().run(command=command, context=context)
        from dagster_k8s import PipesK8sClient

        args = self.k8s_run_args(command, gpus, data_root, str(Path.cwd()))
        return PipesK8sClient().run(context=context, **args)
