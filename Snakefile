# statereduce: key/query channel pruning of linear-attention LMs (Nazari & Rusch, 2026).
# Logic lives in the package `statereduce/`; rules/common.smk validates the config and defines inputs, cli.smk checks
# the command line, resources.smk says where jobs run and what they ask for.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/cli.smk"
include: "rules/resources.smk"
include: "rules/pretrain.smk"
include: "rules/capture.smk"
include: "rules/select.smk"
include: "rules/prune.smk"
include: "rules/rft.smk"
include: "rules/export.smk"
include: "rules/evaluate.smk"
include: "rules/analysis.smk"
include: "rules/studies.smk"
include: "rules/speed.smk"


rule all:
    input:
        get_final_output(),
    default_target: True


rule all_paper:
    """The default target plus the rank analysis, its tables and figures (paper Tables 5, 6, App. C.2, Figs. 2, 3, 5),
    all captioned in `snakemake --report report.html all_paper`."""
    input:
        get_paper_output(),
