# The studies of config `studies:` (statereduce/studies/: one module each): one rule per study, defined here from
# the registry. A study's cells are ordinary targets of the other rules; its rule writes its tables (Markdown, CSV,
# the HTML page and the report caption) and figures from them.


def study_block(study):
    """The study's config block; a one-line error where the config has none (a table asked for by path)."""
    block = CFG.get("studies", {}).get(study.name)
    if block is None:
        raise WorkflowError(f"study {study.name!r} is not configured: add a studies.{study.name} block to the config "
                            f"to build {', '.join(t.name for t in study.tables)}")
    return block


def study_report(study, name, path):
    """The output ``name`` of the study's rule, marked for the report where it is a table (Markdown or HTML page) or
    a figure; its caption is the one the rule writes next to it."""
    for t in study.tables:
        for ext, key in (("md", t.name), ("html", f"{t.name}_html")):
            if name == key:
                return report(path, caption=os.path.abspath(layout.table(t.name, "rst")), category="Tables",
                              labels={"table": t.label, "format": {"md": "Markdown", "html": "HTML"}[ext]})
    for f in study.figures:
        if name == f.name:
            return report(path, caption=os.path.abspath(f"{path[: -len('.png')]}.rst"), category="Figures",
                          labels={"figure": f.label})
    return path


def study_outputs():
    """The tables (Markdown and HTML page) and figures of every configured study: what ``all_paper`` asks for."""
    out = []
    for name in STUDIES:
        study = srstudies.get_study(name)
        out += [layout.table(t.name, ext) for t in study.tables for ext in ("md", "html")]
        out += [layout.figure(f.name) for f in study.figures]
    return out


for _study in srstudies.registered().values():

    rule:
        name:
            _study.rule
        input:
            unpack(lambda wildcards, s=_study: s.inputs(CFG, study_block(s), STUDIES[s.name])),
        output:
            **{k: study_report(_study, k, p) for k, p in srstudies.outputs(_study).items()},
        params:
            study=_study.name,
            data=lambda wildcards, s=_study: srconfig.canonical(s.params(CFG, study_block(s), STUDIES[s.name])),
        log:
            f"logs/{_study.rule}/{_study.rule}.log",
        benchmark:
            f"benchmarks/{_study.rule}/{_study.rule}.tsv"
        conda:
            conda_env("lm_eval")
        script:
            "../workflow_scripts/study.py"
