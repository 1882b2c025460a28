"""The record format of a run, defined once: what a run writes and every view reads, in one package.

* `lines`: the flight recorder's lines (header, step, end, report), their builders, the roll-up of a step's gradient
  rows, and the typed views every view reads them through;
* `summary`: the watch's summary, one frozen section per part (``WatchSummary``), the shape of the end line's
  ``summary`` and of ``Report.extra["watch"]``;
* `report_json`: the JSON report (``ampdoctor run --json``) and the typed keys of ``Report.extra``;
* `file`: the flight recorder's file, appended and read back whole, torn or restarted.
"""

from ampdoctor.core.records.file import (
    LOG_NAME,
    SCHEMA,
    FlightRecorder,
    LogRun,
    append_report,
    log_name,
    rank_of_log,
    read_log,
    read_runs,
)
from ampdoctor.core.records.lines import (
    OLD_WATCH_SCHEMAS,
    WATCH_SCHEMA,
    Activations,
    End,
    Gradients,
    Header,
    Layout,
    Loss,
    LostUpdates,
    ParamLost,
    Recording,
    Scale,
    Step,
    Updates,
    end_line,
    gradient_rows,
    gradients_entry,
    header_line,
    header_problem,
    is_header,
    loss_entry,
    lost_updates_entry,
    param_stats,
    read_recording,
    read_step,
    report_line,
    rollup,
    scale_entry,
    step_line,
    updates_entry,
)
from ampdoctor.core.records.numerics import AuditedOp, AuditSection, StateSection
from ampdoctor.core.records.report_json import (
    REPORT_SCHEMA,
    Extras,
    RanksExtra,
    read_finding,
    report_fields,
    report_to_dict,
)
from ampdoctor.core.records.summary import (
    ActivationModule,
    ActivationSummary,
    Arrival,
    AverageCopy,
    Coverage,
    FirstNonfinite,
    GenericSection,
    GradientSummary,
    LossSummary,
    LostSummary,
    ScaleSummary,
    Section,
    StageSummary,
    Stats,
    UpdatesSummary,
    Verified,
    WatchSummary,
    register_section,
)

__all__ = ["WATCH_SCHEMA", "OLD_WATCH_SCHEMAS", "REPORT_SCHEMA", "header_line", "step_line", "end_line",
           "report_line", "header_problem", "gradient_rows", "gradients_entry", "scale_entry", "lost_updates_entry",
           "updates_entry", "loss_entry", "param_stats", "rollup", "Layout", "Header", "Gradients", "Scale",
           "ParamLost", "LostUpdates", "Updates", "Loss", "Activations", "Step", "End", "Recording", "read_step",
           "read_recording", "is_header", "report_to_dict", "report_fields", "read_finding", "SCHEMA", "LOG_NAME",
           "FlightRecorder", "LogRun", "append_report", "log_name", "rank_of_log", "read_log", "read_runs", "Extras",
           "RanksExtra", "Section", "GenericSection", "register_section", "Stats", "ScaleSummary", "Arrival",
           "GradientSummary", "LostSummary", "UpdatesSummary", "LossSummary", "FirstNonfinite", "ActivationModule",
           "ActivationSummary", "AverageCopy", "Verified", "Coverage", "StageSummary", "WatchSummary",
           "AuditedOp", "AuditSection", "StateSection"]
