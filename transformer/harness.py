"""The lm-evaluation-harness command: a training workdir as the `lm_eval` model "transformer".

    python -m transformer.harness --model transformer \
        --model_args workdir=runs/gpt,batch_size=16 --tasks hellaswag,lambada_openai

takes the `lm_eval` command's flags (it is that command with this model registered: lm-eval
0.4 finds models only in its own registry, which a module must be imported to join). In
Python, `lm_eval.simple_evaluate(model=TransformerLM(workdir=...), tasks=[...])`.

The adapter itself (scoring, rolling windows, generate_until) is `transformer.hf.harness`'s,
over params in memory; `TransformerLM` here loads them from a workdir (`generate.load_workdir`).
"""

from __future__ import annotations

import functools
import sys

from lm_eval.api.registry import register_model

from transformer import generate
from transformer.hf import harness
from transformer.training import task_eval
from transformer.utils import fileio


@register_model("transformer")
class TransformerLM(harness.TransformerLM):
    """A causal decoder LM (model.family "gpt") restored from a training workdir."""

    # its --model_args: lm-eval's HF model's chat options too (`harness.chat_options`)
    ARGS = ("workdir", "step", "batch_size", "max_length", "chat_template_args",
            "enable_thinking", "think_end_token")

    def __init__(self, workdir: str, step: int | None = None, batch_size: int | str = 8,
                 max_length: int | None = None, **chat):
        # (checked before the checkpoint is read)
        step = None if step in (None, "") else harness.int_arg("step", step, least=0)
        harness.int_arg("batch_size", batch_size, auto=True)
        if max_length not in (None, "", 0):
            harness.int_arg("max_length", max_length)
        harness.chat_options(**chat)
        workdir = str(workdir)
        if not workdir.startswith("hf:") and not fileio.isdir(workdir):
            raise FileNotFoundError(f"workdir={workdir!r} " + (
                "is a file" if fileio.isfile(workdir) else "does not exist") +
                ": expected a training workdir (or hf:DIR, a Hugging Face checkpoint)")
        super().__init__(*generate.load_workdir(workdir, step), batch_size, max_length, **chat)

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        # The command's --batch_size (default 1) yields to a batch_size in --model_args; its
        # device / max_batch_size do not apply (JAX places the model itself).
        unknown = sorted(set(arg_dict) - set(cls.ARGS))
        if unknown:
            raise ValueError(f"--model_args {', '.join(unknown)}: the model 'transformer' takes "
                             f"only {', '.join(cls.ARGS)}")
        if not arg_dict.get("workdir"):
            raise ValueError("--model_args workdir=...: expected a training workdir or hf:DIR "
                             "(a Hugging Face checkpoint) to evaluate")
        extra = {k: v for k, v in (additional_config or {}).items()
                 if k == "batch_size" and v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config=None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)


def _checking_tasks(simple_evaluate):
    """`simple_evaluate` that first checks its tasks as the command resolved them, in one line
    before the model loads: a local task's splits (`task_eval.check_splits`; lm-eval's own
    error was a bare KeyError or StopIteration), and log-likelihood tasks under
    enable_thinking=true (lm-eval's HF model refuses them only after every generation ran)."""

    @functools.wraps(simple_evaluate)
    def checked(*args, **kwargs):
        configs = task_eval.task_configs(list(kwargs.get("tasks") or []),
                                         kwargs.get("task_manager"))
        task_eval.check_splits(configs)
        if _thinking(kwargs.get("model"), kwargs.get("model_args")) and (scored := [
                task for task, config in configs.items()
                if config.get("output_type") in harness.SCORED]):
            raise harness.thinking_refuses(scored)
        return simple_evaluate(*args, **kwargs)

    return checked


def _thinking(model, model_args) -> bool:
    """Whether simple_evaluate's model is this one ("transformer") with enable_thinking=true."""
    if isinstance(model_args, str):
        from lm_eval.utils import simple_parse_args_string

        model_args = simple_parse_args_string(model_args)
    return model == "transformer" and (model_args or {}).get("enable_thinking") is True


def main() -> None:
    """The `lm_eval` command with the "transformer" model registered, run by `cli.run` as every
    command is: the same platform choice (the CPU, where there is no TPU or GPU, without probing
    libtpu) and one-line errors (a local task's missing or empty split too, before the model
    loads). The flags are lm_eval's, but for this project's --verbose."""
    from absl import logging
    from lm_eval.__main__ import cli_evaluate

    from transformer.utils import cli

    ours = [a for a in sys.argv[1:] if a.partition("=")[0] == "--verbose"]
    theirs = [a for a in sys.argv[1:] if a not in ours]

    def evaluate(argv: list[str]) -> None:
        logging.set_verbosity(logging.WARNING)  # absl's; lm_eval's own logs are as they were
        from lm_eval import evaluator  # (after: importing it logs `datasets`' INFO lines)

        evaluator.simple_evaluate = _checking_tasks(evaluator.simple_evaluate)
        sys.argv = ["lm_eval", *theirs]
        cli_evaluate()

    sys.argv[1:] = ours
    cli.run(evaluate)


if __name__ == "__main__":
    main()
