# The command line as Snakemake read it, the checks of what it asks for before any job is planned, and the report
# at the end of a run.
import contextlib
import io

from snakemake.logging import logger


def command_line():
    """Snakemake's own reading of the ``snakemake`` command line (targets, executor, profiles applied), or None when
    Snakemake was started otherwise (its Python API, a job's own process).

    Snakemake 9 reads this Snakefile before it hands the targets to the workflow (``workflow.dag_settings`` is still
    unset here, an ``onstart`` handler runs only in real runs and after the jobs are planned, and a target that names
    an unknown model matches no rule, so no input function sees it), and a dry run plans with the local dry-run
    executor whatever ``--executor`` says. So both come from ``sys.argv``, through ``snakemake.cli.parse_args``: the
    function ``snakemake`` itself parsed it with before it read this file, which gives the same result for any order
    of options and targets that Snakemake accepts. (An option of several values, such as ``--resources``,
    ``--forcerun`` or ``--until``, takes every word up to the next option: a target right after it is read as one of
    its values by Snakemake itself, or stops Snakemake before it reads this file. Targets go first, or after ``--``,
    which ends the options.)"""
    prog = Path(sys.argv[0])
    if prog.name != "snakemake" and prog.parts[-2:] != ("snakemake", "__main__.py"):
        return None
    try:
        from snakemake.cli import parse_args

        with contextlib.redirect_stderr(io.StringIO()):  # its "Using profile ..." line, printed once already
            args = parse_args(sys.argv[1:])[1]
    except (Exception, SystemExit):
        return None
    return args if args.mode == ExecMode.DEFAULT else None


CLI = command_line()

# Every word after `--` is a target: an option there (`-- <target> -n`) would be a target that no rule makes.
for _target in sorted(t for t in CLI.targets if t.startswith("-")) if CLI else []:
    raise WorkflowError(
        f"{_target} stands after --, which makes every word after it a target: put the options before -- "
        f"(snakemake --cores all {_target} -- <targets>)"
    )

# A requested path under results/ naming an unknown model, selector or calibration, or an impossible pct, fails here
# in one line with the valid choices (Snakemake alone would answer only "No rule to produce ...").
for _target in sorted(CLI.targets) if CLI else []:
    try:
        srconfig.check_target(CFG, os.path.relpath(_target) if os.path.isabs(_target) else _target)
    except srconfig.ConfigError as e:
        raise WorkflowError(str(e)) from None

# With no target, a list of rule names and paths after --forcerun, --until, --omit-from or --prioritize means that the
# option took the targets: Snakemake would build the default target instead (`-R select_channels <target>` plans every
# selection and all that depends on them) or stop with "BUG: Out of jobs ready" (`--until`). One line instead.
for _option, _values in (("--forcerun", CLI.forcerun), ("--until", CLI.until), ("--omit-from", CLI.omit_from),
                         ("--prioritize", CLI.prioritize)) if CLI and not CLI.targets else []:
    _paths, _rules = sorted(v for v in _values or () if "/" in v), sorted(v for v in _values or () if "/" not in v)
    if _paths and _rules:
        raise WorkflowError(
            f"no target was given: {_option} read {' '.join(_paths)} as its own values (it takes every word up to "
            f"the next option); put the targets first: snakemake {' '.join(_paths)} {_option} {' '.join(_rules)} ..."
        )


# ---- the report at the end of a run ------------------------------------------------------------------------------
def requested_files():
    """What this run was asked for: the command line's file targets and the inputs of its target rules (the default
    target's without any); none where Snakemake was started otherwise (its Python API)."""
    if CLI is None:
        return []
    files = []
    for target in CLI.targets or [workflow.default_target]:
        if workflow.is_rule(target):
            files += [f for f in workflow.get_rule(target).input if isinstance(f, str)]
        else:
            files.append(os.path.relpath(target) if os.path.isabs(target) else target)
    return files


def end_of_run(log, failed):
    """Print what the run made, where its jobs' logs lie, its wall time and, when it failed, the failed jobs' logs
    (statereduce.core.run_report). Snakemake calls it after real runs only (not -n, not with nothing to do, not in
    the jobs it spawns); a report that cannot be made is one line, and never fails the run."""
    try:
        from statereduce.core.run_report import report

        text = report(log, requested_files(), failed=failed)
    except Exception as e:
        text = f"Run summary (statereduce): none ({type(e).__name__})"
    if text:
        logger.info(text)


onsuccess:
    end_of_run(log, failed=False)


onerror:
    end_of_run(log, failed=True)
