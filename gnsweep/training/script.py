"""A task=script run's runner, by the names it had before it was cut into rooms, so that code
importing `gnsweep.training.script` keeps working. The rooms: `script_command` (the command
and its placeholders), `log_reader` (the script's printed lines), `script_rows` (the rows read
and written), `script_process` (the child process and its signals), `script_runner` (a run,
start to end, and its recovery); new code imports from them."""

from gnsweep.training.log_reader import LineReader
from gnsweep.training.script_command import (
    command,
    environment,
    placeholder_values,
    source_of,
    torchrun_args,
)
from gnsweep.training.script_process import Child
from gnsweep.training.script_rows import RowLog, TableLog
from gnsweep.training.script_runner import recovered, run_script

__all__ = ["Child", "LineReader", "RowLog", "TableLog", "command", "environment",
           "placeholder_values", "recovered", "run_script", "source_of", "torchrun_args"]
