# Image difference captioning: one DAG from raw data to the papers' tables.
#
#   snakemake --cores 8 results/tables/clevr_change.csv
#
# Table of contents (each stage is `python -m pipeline <stage>`; all logic lives in pipeline/):
#   rules/data.smk      raw data (synthetic world or official release) -> manifest
#   rules/features.smk  backbone features -> HDF5
#   rules/text.smk      tokenisation, vocabulary, encoded captions
#   rules/train.smk     training with validation-based selection -> checkpoint; test decoding
#   rules/baselines.smk sanity rows (most frequent caption, nearest neighbour)
#   rules/evaluate.smk  scoring of test predictions
#   rules/tables.smk    the paper tables (CSV + Markdown + .meta.json notes sidecar)
#   rules/plots.smk     learning curves of every table's methods (inputs of the table rule)
#   rules/report.smk    the HTML report's figures per table (snakemake --report report.html)

from snakemake.utils import min_version

min_version("9.0")


configfile: os.path.join(workflow.basedir, "config/config.yaml")


report: "workflow/report/workflow.rst"


include: "rules/common.smk"
include: "rules/data.smk"
include: "rules/features.smk"
include: "rules/text.smk"
include: "rules/train.smk"
include: "rules/baselines.smk"
include: "rules/evaluate.smk"
include: "rules/tables.smk"
include: "rules/plots.smk"
include: "rules/report.smk"
include: "rules/clip4idc.smk"
include: "rules/aux.smk"
include: "rules/negatives.smk"
include: "rules/idc_pcl.smk"


rule all:
    input:
        expand("results/tables/{table}.csv", table=list(config["tables"])),
        expand("results/report/{table}/items.txt", table=list(config["tables"])),
    default_target: True
