"""The training process Dagster launches through Pipes: `torchrun ... -m
eagle3_assets.training_entry RUN.json`. Rank 0 streams each step to the run log and reports
the materialization; the other ranks only train. Kept out of `defs/` (its imports are heavy)
and out of `lib/` (it speaks the Pipes protocol)."""

import os
import sys
from pathlib import Path

from dagster_pipes import PipesContext, open_dagster_pipes

from eagle3_assets.lib.core.charts import line_chart_svg, markdown_image
from eagle3_assets.lib.hidden_states.streaming import ProducerFailed
from eagle3_assets.lib.training.train_drafter import (
    Interrupted,
    RunConfig,
    TrainingResult,
    distributed,
    train,
    training_metadata,
)


def _train(config: RunConfig, pipes: PipesContext | None) -> int:
    def report(metrics: dict) -> None:
        if pipes is not None:
            accuracy = ", ".join(f"{a:.3f}" for a in metrics["accuracy"])
            streamed = ""
            if "spool_bytes" in metrics:
                streamed = (
                    f"; spool {metrics['spool_bytes'] / 2**20:.1f} of "
                    f"{metrics['spool_window_bytes'] / 2**20:.1f} MB, producer "
                    f"{metrics['producer_tokens_per_s']:,.0f} tokens/s, waited: trainer "
                    f"{metrics['trainer_waited_s']:.1f} s, producer "
                    f"{metrics['producer_waited_s']:.1f} s"
                )
            pipes.log.info(
                f"step {metrics['step']}/{config.steps}: loss {metrics['loss']:.4f}, "
                f"accuracy by TTT position [{accuracy}], lr {metrics['lr']:.2e}, "
                f"{metrics['tokens_per_s']:,.0f} tokens/s{streamed}"
            )

    try:
        result = train(config, report)
    except Interrupted as stopped:
        if pipes is not None:
            pipes.log.warning(f"{stopped}; materialize again to resume")
        return 130
    except ProducerFailed as failed:  # streamed: the run log says why, not only stderr
        if pipes is not None:
            pipes.log.error(str(failed))
        return 1
    if pipes is not None:
        pipes.report_asset_materialization(metadata=typed_metadata(config, result))
    return 0


# How the UI shows each value that is not a plain number: lists as JSON, folders as paths.
TYPES = {
    "final_accuracy_by_position": "json",
    "loss_curve": "json",
    "checkpoint": "path",
    "export": "path",
}


def typed_metadata(config: RunConfig, result: TrainingResult) -> dict:
    """training_metadata with the types the UI renders, and the loss and accuracy charts."""
    metadata: dict = {
        key: {"raw_value": value, "type": TYPES[key]} if key in TYPES else value
        for key, value in training_metadata(config, result).items()
    }
    metadata["curves"] = {"raw_value": curves(result.history), "type": "md"}
    return metadata


def curves(history: list[dict]) -> str:
    """Loss and per-position accuracy over the steps, as two inline chart images."""
    loss = line_chart_svg("TTT loss", {"loss": [m["loss"] for m in history]})
    positions = len(history[0]["accuracy"]) if history else 0
    accuracy = line_chart_svg(
        "accuracy by TTT position",
        {f"pos {k}": [m["accuracy"][k] for m in history] for k in range(positions)},
    )
    return f"{markdown_image(loss, 'loss')}\n\n{markdown_image(accuracy, 'accuracy')}"


def main() -> int:
    config = RunConfig.from_json(Path(sys.argv[1]))
    with distributed(config.platform):
        if int(os.environ.get("RANK", "0")) == 0:
            with open_dagster_pipes() as pipes:
                return _train(config, pipes)
        return _train(config, None)


if __name__ == "__main__":
    raise SystemExit(main())
