import pytest


@pytest.fixture(scope="session")
def tiny_dag(tmp_path_factory):
    """One folder for the tiny configuration's DAG, shared by the modules that build targets in it
    (tests/test_workflow.py, tests/test_report.py): each asks Snakemake for its own targets, and what another
    module built there already (a dataset's synthetic world, features, runs) is not built twice in a session."""
    return tmp_path_factory.mktemp("dag")
