"""lm-eval tasks during training (config.eval_tasks): logged like validation, equal to the harness
adapter's scores of the saved params, and refused in one line where they cannot run."""

import json

import pytest

lm_eval = pytest.importorskip("lm_eval")

from test_harness import evaluate, write_tasks  # noqa: E402
from test_train import TINY_MODEL, read_metrics  # noqa: E402

from transformer import configs, train  # noqa: E402
from transformer.harness import TransformerLM  # noqa: E402
from transformer.training import task_eval  # noqa: E402


def tiny_config(tasks_dir, **more):
    config = configs.experiment("gpt_tiny")
    config.update(steps=20, batch_size=4, seq_len=32, log_every=10, eval_every=20, eval_steps=1,
                  checkpoint_every=20, eval_tasks=(str(tasks_dir / "mc.yaml"),),
                  eval_tasks_every=10, **more)
    config.model.update(**TINY_MODEL)
    return config


@pytest.fixture(scope="module")
def shared_tasks(tmp_path_factory):
    """The local tasks, good and bad (`bad_tasks`), in one folder that the tests below share:
    lm-eval's index of its own tasks and of that folder (task_eval.manager) is built once per
    process (seconds each time)."""
    return bad_tasks(write_tasks(tmp_path_factory.mktemp("tasks")))


@pytest.mark.slow
def test_tasks_are_scored_during_training_and_logged_like_validation(shared_tasks, tmp_path):
    workdir = tmp_path / "run"
    train.train_and_evaluate(tiny_config(shared_tasks), str(workdir))
    records = [r for r in read_metrics(workdir) if r["split"] == "tasks"]
    assert [r["step"] for r in records] == [10, 20]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["tasks/local_mc/acc"] == records[-1]["local_mc/acc"]
    # The last score is the harness adapter's on the saved step-20 params.
    want = evaluate(TransformerLM(workdir=str(workdir), batch_size=4), tmp_path, "local_mc")
    assert records[-1]["local_mc/acc"] == pytest.approx(want["acc,none"])


@pytest.mark.parametrize("more, model, message", [
    # lm-eval reads every task YAML it ships to know the names: 15 s, the slow tier's
    pytest.param(dict(eval_tasks=("no_such_task_xyz",)), {},
                 "eval_tasks: unknown lm-eval task(s) ['no_such_task_xyz']",
                 marks=pytest.mark.slow),
    (dict(eval_tasks=("missing.yaml",)), {}, "eval_tasks: 'missing.yaml': no such task file"),
    # its 8 new tokens would leave an 8-token context no room for the prompt
    pytest.param(dict(seq_len=8, tasks="gen.yaml"), {},
                 "eval_tasks: 'local_gen' generates max_gen_toks=8 tokens: expected fewer than "
                 "seq_len=8", marks=pytest.mark.slow),
    (dict(eval_tasks_every=-1), {}, "eval_tasks_every=-1: expected an int >= 0"),
    ({}, dict(family="bert"), "eval_tasks with model.family='bert': expected a causal decoder "
                              "LM ('gpt')"),
])
def test_tasks_that_cannot_run_are_refused_in_one_line_before_training(shared_tasks, more, model,
                                                                        message):
    tasks_dir = shared_tasks
    config = tiny_config(tasks_dir)
    more = {k: (str(tasks_dir / v),) if k == "tasks" else v for k, v in more.items()}
    config.update({"eval_tasks" if k == "tasks" else k: v for k, v in more.items()})
    config.model.update(model)
    with pytest.raises(ValueError) as error:
        configs.validate_config(config)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
    with pytest.raises(ValueError):
        configs.validate_config(config, num_processes=1)


def test_several_processes_are_refused():
    config = configs.base_config()
    config.eval_tasks = ("lambada_openai",)
    with pytest.raises(ValueError, match=r"^eval_tasks on 2 processes: expected one"):
        task_eval.check(config, "causal", num_processes=2)


def test_results_flatten_to_task_and_metric_names():
    results = {"mc": {"alias": "mc", "acc,none": 0.5, "acc_stderr,none": 0.1},
               "gen": {"exact_match,strict": 1, "exact_match,none": 0.25, "sample_len": True},
               "rolling": {"word_perplexity,none": 9.5, "sample_len": 3}}  # (3 documents)
    assert task_eval.flatten(results) == {"mc/acc": 0.5, "mc/acc_stderr": 0.1,
                                          "gen/exact_match,strict": 1.0,
                                          "gen/exact_match": 0.25,
                                          "rolling/word_perplexity": 9.5}


def bad_tasks(directory):
    """Local tasks lm-eval cannot build (its error was a bare KeyError, or StopIteration): a
    split their data_files lack (from an `include:`d template), an empty file."""
    (directory / "empty.jsonl").write_text("\n")
    (directory / "_mc_template").write_text(
        "dataset_path: json\ntest_split: tst\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: answer\n")
    for name, split, path in (("badsplit", "tst", "mc.jsonl"), ("empty", "test", "empty.jsonl")):
        (directory / f"{name}.yaml").write_text(
            f"include: _mc_template\ntask: local_{name}\ndataset_kwargs:\n  data_files:\n"
            f"    test: {directory / path}\n" + ("test_split: test\n" if split == "test" else ""))
    return directory


BAD_SPLIT = ("task 'local_badsplit': test_split='tst' is not among its data_files' splits "
             "['test']: expected one of those")


def test_a_local_tasks_missing_or_empty_split_is_one_line(tmp_path):
    from lm_eval.tasks import TaskManager

    tasks_dir = bad_tasks(write_tasks(tmp_path / "tasks"))
    # a group (with its own YAML) of tasks and of a tag, overriding a member's settings
    (tasks_dir / "gen_tagged.yaml").write_text(
        (tasks_dir / "gen.yaml").read_text().replace("task: local_gen", "task: local_gen2\n"
                                                     "tag: [local_tag]"))
    (tasks_dir / "group.yaml").write_text(
        "group: local_group\ntask:\n  - local_mc\n  - local_tag\n  - task: local_gen\n"
        "    generation_kwargs:\n      until: ['\\n']\n      max_gen_toks: 40\n")
    (tasks_dir / "bad_group.yaml").write_text(
        "group: local_bad_group\ntask:\n  - local_group\n  - local_badsplit\n")
    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)

    def check(tasks):
        task_eval.check_splits(task_eval.task_configs(tasks, manager))

    check(["local_mc", "local_rolling", "local_gen", "hellaswag", "local_group"])
    empty = (f"task 'local_empty': its test_split 'test' has no documents "
             f"({tasks_dir / 'empty.jsonl'} is empty): expected at least one")
    for names, message in ((["local_badsplit"], BAD_SPLIT), (["local_empty"], empty),
                           (["local_bad_group"], BAD_SPLIT)):  # (a task in a group)
        with pytest.raises(ValueError) as error:
            check(["local_mc", *names])
        assert str(error.value) == message
    # The generations' lengths: the group's override of local_gen's, the tag's task's own.
    configs = task_eval.task_configs(["local_group"], manager)
    assert sorted(configs) == ["local_gen", "local_gen2", "local_mc"]
    assert task_eval.generation_lengths(configs) == {"local_gen": 40, "local_gen2": 8}
    assert configs["local_mc"]["output_type"] == "multiple_choice"
    # a YAML file given as a task (the command's --tasks my_task.yaml) comes as its config;
    # a lone file list is datasets' "train" split
    config = {"task": "mine", "dataset_path": "json", "test_split": "test",
              "dataset_kwargs": {"data_files": str(tasks_dir / "mc.jsonl")}}
    with pytest.raises(ValueError, match=r"^task 'mine': test_split='test' is not among its "
                                         r"data_files' splits \['train'\]: expected one"):
        task_eval.check_splits(task_eval.task_configs([config], None))
    task_eval.check_splits(task_eval.task_configs([{**config, "test_split": "train"}], None))


@pytest.mark.slow  # (lm-eval's index of its own tasks: 15 s)
def test_a_local_tasks_missing_split_is_refused_before_training(shared_tasks):
    config = tiny_config(shared_tasks)
    config.eval_tasks = (str(shared_tasks / "badsplit.yaml"),)
    with pytest.raises(ValueError, match=r"^eval_tasks: " + BAD_SPLIT.replace("[", r"\[")):
        configs.validate_config(config)
