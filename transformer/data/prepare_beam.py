"""`prepare` as an Apache Beam pipeline, for corpora past one machine:

    python -m transformer.data.prepare --engine=beam --output_dir=DIR --input=PATH ... \
        [--beam_options="--runner=DataflowRunner --project=P --region=R ..."]

The same preparation as the worker processes' (transformer.data.prepare), on Beam's runners:
by default its in-process FnApiRunner (what the DirectRunner runs on when it does not first fetch
the Prism runner from GitHub; --beam_options="--direct_num_workers=4
--direct_running_mode=multi_threading" spreads it over threads), Dataflow, Flink or Spark elsewhere.
The driver (this process) checks the arguments, builds and saves the tokenizer and the
settings (`prepare_units.begin`); the pipeline's elements are the input files still to do,
each given to a DoFn that runs `prepare_units.prepare_unit` with the tokenizer saved in DIR; the
driver then writes prepare.json from the files' records (`prepare_units.finish`). So the output
is the worker processes' byte for byte, and an interrupted pipeline, or a prepare begun by
either engine, resumes with either. The workers read the input and write DIR at the driver's
paths: a local disk with the local runners, a filesystem every worker mounts otherwise.
"""

import logging
import shlex

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

from transformer.data import prepare_units
from transformer.data import tokenizers as tokenizers_lib

DEFAULT_RUNNER = "FnApiRunner"


class PrepareUnit(beam.DoFn):
    """An input file's index -> its record, after `prepare_units.prepare_unit` wrote its shards
    (Beam counters `prepare/documents` and `prepare/tokens` show the progress)."""

    def __init__(self, output_dir: str, settings: dict):
        self._output_dir, self._settings = output_dir, settings
        self._tokenizer = None

    def setup(self) -> None:
        self._tokenizer = tokenizers_lib.load_tokenizer(self._output_dir)
        self._documents = beam.metrics.Metrics.counter("prepare", "documents")
        self._tokens = beam.metrics.Metrics.counter("prepare", "tokens")

    def process(self, index: int):
        encode_batch = self._tokenizer.encode_batch

        def progress(documents: int, tokens: int) -> None:
            self._documents.inc(documents)
            self._tokens.inc(tokens)

        yield prepare_units.prepare_unit(self._output_dir, self._settings, index,
                                         lambda batches: map(encode_batch, batches), progress)


def options(beam_options: str) -> PipelineOptions:
    """The pipeline's options from a command line of Beam flags (the runner DEFAULT_RUNNER
    unless it names one); an unknown flag is a one-line error."""
    args = shlex.split(beam_options)
    parsed = PipelineOptions(args)
    if parsed.view_as(StandardOptions).runner is None:
        parsed = PipelineOptions([f"--runner={DEFAULT_RUNNER}", *args])
    logger = logging.getLogger("apache_beam.options.pipeline_options")
    level = logger.level
    logger.setLevel(logging.ERROR)  # its warning for each unknown flag: the error says it
    try:
        unknown = [arg for arg in parsed.get_all_options(retain_unknown_options=True)
                   if arg not in parsed.get_all_options()]
    finally:
        logger.setLevel(level)
    if unknown:
        raise ValueError(f"beam_options={beam_options!r}: unknown Beam options {unknown}: "
                         "expected Beam pipeline options such as --runner=FnApiRunner")
    return parsed


def run(output_dir: str, settings: dict, todo: list[int], beam_options: str = "") -> None:
    """Prepares the input files `todo` (indices into settings["units"]) in a Beam pipeline."""
    with beam.Pipeline(options=options(beam_options)) as pipeline:
        _ = (pipeline
             | "input files" >> beam.Create(todo)
             | "spread" >> beam.Reshuffle()  # one file an element, to any worker
             | "tokenize and write" >> beam.ParDo(PrepareUnit(output_dir, settings)))
