"""Part-of-speech taggers for the FDA hard negatives (IDC-PCL appendix A.2), and stage ``stanza-models``.

Two taggers behind one interface, ``tag(sentences) -> [[(upos, tag), ...], ...]`` over pre-tokenised
sentences (so tags align one-to-one with the pipeline's tokens):

- ``StanzaTagger``: stanza ``tokenize,pos`` loaded from an explicit model directory with
  ``download_method=None`` (never downloads at run time). ``upos`` is the Universal tag, ``tag`` the
  Penn Treebank tag (``xpos``: JJ, JJR, NN, NNS …), the tag set of the paper's Table 8 (the paper used
  Stanford CoreNLP, whose English tagger writes the same PTB tags).
- ``LexiconTagger``: a synthetic world knows the part of speech of every word it writes; its lexicon tags
  synthetic data without any model (``tag`` = ``upos`` there). A word outside the lexicon is an error:
  that data was not written by the world, and needs stanza.

Every tagger has a ``name`` that the negatives file records, so a file always says which tagger made it.

Stage ``python -m pipeline stanza-models --dir resources/stanza`` places stanza's English ``tokenize,pos``
models under ``--dir`` (one download rule: parallel downloads corrupt stanza's resources.json). Where the
host cannot be reached it stops with one message saying what to place where.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Protocol, Sequence

from pipeline.errors import PipelineError

# Synthetic worlds' lexicons (dataset id -> "module:attribute"); each maps word -> Universal POS tag.
LEXICONS = {"clevr_change": "pipeline.synth.captions:POS_LEXICON",
            # the bird worlds (Birds-to-Words and its cross-task data CUB) share one vocabulary
            "birds_to_words": "pipeline.synth.birds:POS_LEXICON", "cub": "pipeline.synth.birds:POS_LEXICON"}
STANZA_PROCESSORS = "tokenize,pos"


class Tagger(Protocol):
    name: str

    def tag(self, sentences: Sequence[Sequence[str]]) -> list[list[tuple[str, str]]]:
        """(Universal POS, fine tag) for every token of every sentence."""


class LexiconTagger:
    def __init__(self, lexicon: dict[str, str], name: str):
        self.lexicon = lexicon
        self.name = name

    @classmethod
    def for_dataset(cls, dataset: str) -> "LexiconTagger":
        if dataset not in LEXICONS:
            raise PipelineError(f"no synthetic POS lexicon for dataset {dataset!r} (have: {sorted(LEXICONS)}); "
                                "use tagger: stanza")
        module, attr = LEXICONS[dataset].split(":")
        return cls(getattr(importlib.import_module(module), attr), f"lexicon:{module}.{attr}")

    def tag(self, sentences):
        out = []
        for s in sentences:
            row = []
            for w in s:
                t = self.lexicon.get(w)
                if t is None:
                    raise PipelineError(f"word {w!r} (in {' '.join(s)!r}) is not in the POS lexicon {self.name}: "
                                        "these captions were not written by the synthetic world; use tagger: stanza")
                row.append((t, t))
            out.append(row)
        return out


def stanza_ready(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds stanza's resources.json and English tokenize and pos models."""
    d = Path(model_dir)
    return (d / "resources.json").is_file() and (d / "en" / "tokenize").is_dir() and (d / "en" / "pos").is_dir()


class StanzaTagger:
    def __init__(self, model_dir: str | Path, use_gpu: bool = False, batch_size: int = 5000):
        model_dir = Path(model_dir)
        if not stanza_ready(model_dir):
            raise PipelineError(f"stanza models not found under {model_dir} (need resources.json, en/tokenize, en/pos): "
                                f"{placement_help(model_dir)}")
        import stanza

        try:
            self.nlp = stanza.Pipeline(lang="en", processors=STANZA_PROCESSORS, dir=str(model_dir),
                                       download_method=None, tokenize_pretokenized=True, use_gpu=use_gpu,
                                       pos_batch_size=batch_size, logging_level="WARN")
        except Exception as e:  # stanza raises several types for a broken model folder
            raise PipelineError(f"stanza could not load its models from {model_dir}: {e}") from None
        self.name = f"stanza-{stanza.__version__}:{STANZA_PROCESSORS}:{model_dir}"

    def tag(self, sentences):
        sentences = [list(s) for s in sentences]
        nonempty = [s for s in sentences if s]
        doc = self.nlp(nonempty) if nonempty else None
        tagged = iter(doc.sentences if doc else [])
        out = []
        for s in sentences:
            if not s:
                out.append([])
                continue
            words = next(tagged).words
            if len(words) != len(s):  # pre-tokenised input: stanza must keep our tokens
                raise PipelineError(f"stanza changed the tokenisation of {' '.join(s)!r}")
            out.append([(w.upos, w.xpos or w.upos) for w in words])
        return out


def make_tagger(kind: str, dataset: str, stanza_dir: str | Path) -> Tagger:
    if kind == "lexicon":
        return LexiconTagger.for_dataset(dataset)
    if kind == "stanza":
        return StanzaTagger(stanza_dir)
    raise PipelineError(f"unknown tagger {kind!r} (lexicon | stanza)")


def placement_help(model_dir: str | Path) -> str:
    return (f"on a machine with internet access (raw.githubusercontent.com, huggingface.co) run `python -c \"import stanza; "
            f"stanza.download('en', model_dir='{model_dir}', processors='{STANZA_PROCESSORS}', package='default')\"` "
            f"and copy the folder to {model_dir}/ here (it must hold resources.json and en/), "
            "or use `tagger: lexicon` for synthetic data")


# --------------------------------------------------------------------------------------- stage
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", required=True, help="model folder (resources/stanza)")


def run(args: argparse.Namespace) -> None:
    import stanza

    d = Path(args.dir)
    try:
        stanza.download("en", model_dir=str(d), processors=STANZA_PROCESSORS, package="default")
    except Exception as e:  # no network, proxy, HF outage: one clear message
        raise PipelineError(f"could not download stanza's English {STANZA_PROCESSORS} models to {d} "
                            f"({type(e).__name__}: {str(e)[:200]}); {placement_help(d)}") from None
    if not stanza_ready(d):
        raise PipelineError(f"stanza.download finished but {d} lacks resources.json, en/tokenize or en/pos; "
                            f"{placement_help(d)}")
    print(f"stanza-models: English {STANZA_PROCESSORS} models in {d}")
