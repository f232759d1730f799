"""Numbers the five papers report, transcribed by hand from ``shared/seeds/*.md`` (x100, as printed; the aux
paper's Spot-the-Diff Table 3 prints fractions, 0.081, which are x100 here like every other number).

Each ``PaperRow`` is one row of one paper table for one method id and one block:

- ``total``: the whole test split (semantic changes + distractors);
- ``changed``: changed (semantic-change) pairs only; ``distractor``: distractor (pseudo-change) pairs only
  (the aux paper's Table 2 layout, SCORER's Tables 1 and 7);
- ``by_type``: one metric (``metric``: CIDEr, METEOR or SPICE) per change type: Color, Texture (= our
  ``material``), Add, Drop, Move, Distractor (= ``no_change``). The papers' per-type scores are re-scored on
  each type's subset (DUDA's convention), i.e. our ``by_type.subset_idf``. Rows exist for CLEVR-Change
  only (Spot-the-Diff and Image Editing Request have no change types at all).

Values a table does not report are None (printed "-" in the papers). Where one method is reported by several
papers, the method's own paper is the source of its row; DUDA's own paper (Park et al., ICCV 2019) is not among
the seeds, so DUDA's rows come from the aux paper, which quotes it ("Numbers are taken from respective
papers"). Disagreements between papers are kept in ``note``. A few rows are of systems no method of this pipeline
implements (DDLA, the Spot-the-Diff paper's model): a table shows them when its config block lists them under
``paper_only``.

Seeds (file names under ``shared/seeds/``): ``aux`` = aux-task-duda-tirg-cvpr2021.md,
``pcl`` = idc-pcl-pretraining-aaai2022.md, ``scorer`` = scorer-cbr-iccv2023.md,
``dirl`` = dirl-ccr-eccv2024.md, ``clip`` = clip4idc-aacl2022.md.

Caveat for comparisons: the papers do not share one scorer (shared/reference/official-implementations.md §0.2):
DUDA/SCORER/DIRL use coco-caption with PTB tokenisation and SPICE, CLIP4IDC drops SPICE, IDC-PCL uses its own
copies without PTB tokenisation.
"""

from __future__ import annotations

from dataclasses import dataclass

AUX = "aux-task-duda-tirg-cvpr2021.md"
PCL = "idc-pcl-pretraining-aaai2022.md"
SCORER = "scorer-cbr-iccv2023.md"
DIRL = "dirl-ccr-eccv2024.md"
CLIP = "clip4idc-aacl2022.md"

TOTAL_METRICS = ("BLEU-4", "METEOR", "ROUGE-L", "CIDEr", "SPICE")
TYPE_COLUMNS = ("Color", "Texture", "Add", "Drop", "Move", "Distractor")
# paper column -> manifest change_type
TYPE_TO_CHANGE = {"Color": "color", "Texture": "material", "Add": "add", "Drop": "drop", "Move": "move", "Distractor": "no_change"}
BLOCKS = ("total", "changed", "distractor", "by_type")

# The spine methods (one per system of shared/DESIGN.md), in table order.
SPINE_METHODS = ("duda", "duda_aux", "idc_pcl", "scorer", "scorer_cbr", "dirl", "dirl_ccr", "clip_ft", "clip4idc")


@dataclass(frozen=True)
class PaperRow:
    method: str
    dataset: str
    block: str
    source: str  # "<seed file> Table N"
    values: dict[str, float | None]
    metric: str | None = None  # by_type only
    label: str = ""  # the row's name in the paper
    note: str = ""

    def value(self, key: str) -> float | None:
        return self.values.get(key)


def _m(b4=None, m=None, r=None, c=None, s=None) -> dict[str, float | None]:
    return {"BLEU-4": b4, "METEOR": m, "ROUGE-L": r, "CIDEr": c, "SPICE": s}


def _t(color=None, texture=None, add=None, drop=None, move=None, distractor=None) -> dict[str, float | None]:
    return {"Color": color, "Texture": texture, "Add": add, "Drop": drop, "Move": move, "Distractor": distractor}


def _rows() -> list[PaperRow]:
    R = PaperRow
    cc, dc, sd, ier = "clevr_change", "clevr_dc", "spot_the_diff", "image_editing_request"
    b2w = "birds_to_words"
    rows = [
        # ---------------------------------------------------------------- CLEVR-Change, whole test split
        R("duda", cc, "total", f"{AUX} Table 1", _m(b4=47.3, m=33.9, c=112.3, s=24.5), label="DUDA [25]",
          note=f"quoted from Park et al. 2019 (not in seeds); {PCL} Table 2 and {CLIP} Table 1 quote CIDEr 112.0"),
        R("duda_aux", cc, "total", f"{AUX} Table 1", _m(b4=51.2, m=37.7, r=70.5, c=115.4, s=31.1), label="Ours"),
        R("duda_aux_easy", cc, "total", f"{AUX} Table 4", _m(b4=51.0, m=37.3, r=70.4, c=115.2, s=30.8),
          label="Ours (easy set only)"),
        R("idc_pcl", cc, "total", f"{PCL} Table 2", _m(b4=51.2, m=36.2, r=71.7, c=128.9), label="Ours",
          note="same as Table 4 line 4 (MLM + MVCL + FDA)"),
        R("idc_pcl_no_pretrain", cc, "total", f"{PCL} Table 4", _m(b4=32.7, m=27.7, r=57.2, c=89.8),
          label="1 None (fine-tuning only)"),
        R("idc_pcl_mlm", cc, "total", f"{PCL} Table 4", _m(b4=36.7, m=28.2, r=60.9, c=94.9), label="2 MLM"),
        R("idc_pcl_mlm_mvcl", cc, "total", f"{PCL} Table 4", _m(b4=50.3, m=37.6, r=70.6, c=119.7),
          label="3 MLM + MVCL"),
        R("idc_pcl_no_de", cc, "total", f"{PCL} Table 4", _m(b4=49.2, m=35.8, r=68.8, c=107.9),
          label="5 MLM + MVCL + FDA without the image difference encoder"),
        R("idc_pcl_no_dj", cc, "total", f"{PCL} Table 4", _m(b4=49.8, m=36.9, r=69.2, c=123.5),
          label="6 w/o Distractor Judging"),
        R("scorer", cc, "total", f"{SCORER} Table 1", _m(b4=55.8, m=40.8, r=74.0, c=126.0, s=33.0), label="SCORER (Ours)",
          note="same in Table 6"),
        R("scorer_cbr", cc, "total", f"{SCORER} Table 1", _m(b4=56.3, m=41.2, r=74.5, c=126.8, s=33.3),
          label="SCORER+CBR (Ours)", note="same in Table 6"),
        R("subtraction", cc, "total", f"{SCORER} Table 6", _m(b4=53.3, m=38.8, r=72.1, c=119.7, s=31.8), label="Subtraction"),
        R("rr", cc, "total", f"{SCORER} Table 6", _m(b4=55.1, m=40.5, r=73.6, c=123.8, s=32.5),
          label="RR (vanilla representation reconstruction)"),
        R("rr_cbr", cc, "total", f"{SCORER} Table 6", _m(b4=55.8, m=41.0, r=74.2, c=125.5, s=32.9), label="RR+CBR"),
        R("dirl", cc, "total", f"{DIRL}", _m(), label="",
          note="not reported on CLEVR-Change (DIRL's ablations, Tables 6-7, are on CLEVR-DC)"),
        R("dirl_ccr", cc, "total", f"{DIRL} Table 2", _m(), label="DIRL+CCR (Ours)",
          note="whole-split scores not reported: Table 2 holds changed-pairs-only scores (see the changed block)"),
        R("clip_ft", cc, "total", f"{CLIP} Table 5", _m(b4=49.9, m=34.8, r=70.8, c=133.9), label="CLIP-FT"),
        R("clip4idc_no_adapt", cc, "total", f"{CLIP} Table 5", _m(b4=54.2, m=37.9, r=75.4, c=147.5),
          label="CLIP4IDC without the retrieval adaptation loss"),
        R("clip4idc", cc, "total", f"{CLIP} Table 1", _m(b4=56.9, m=38.4, r=76.4, c=150.7), label="CLIP4IDC",
          note="same in Table 5"),
    ]
    # CLIP4IDC Table 7: captioning with the image encoder frozen after adaptation, N_intra / N_inter layers.
    for n_intra, n_inter, b4, m, c, r in (
        (6, 6, 54.0, 37.4, 146.5, 75.2),
        (7, 5, 54.5, 37.5, 148.4, 75.5),
        (8, 4, 54.1, 37.4, 147.3, 75.4),
        (9, 3, 54.8, 37.8, 148.6, 75.8),
        (10, 2, 51.5, 35.4, 134.6, 71.5),
        (11, 1, 45.0, 32.7, 122.8, 67.9),
        (12, 0, 38.8, 29.5, 90.9, 60.6),
    ):
        rows.append(R(f"clip4idc_frozen_intra{n_intra}_inter{n_inter}", cc, "total", f"{CLIP} Table 7",
                      _m(b4=b4, m=m, r=r, c=c), label=f"N_intra={n_intra}, N_inter={n_inter}",
                      note="captioning with the adapted image encoder frozen" + (" (the CLIP4IDC setting)" if n_intra == 9 else "")))

    rows += [
        # ---------------------------------------------------------------- CLEVR-Change, changed pairs only
        R("duda", cc, "changed", f"{AUX} Table 2", _m(b4=42.9, m=29.7, c=94.6, s=19.9), label="DUDA"),
        R("duda_aux", cc, "changed", f"{AUX} Table 2", _m(b4=49.9, m=34.3, r=65.4, c=101.3, s=27.9), label="Ours"),
        R("scorer", cc, "changed", f"{SCORER} Table 1", _m(b4=54.1, m=37.4, r=71.5, c=122.0, s=31.2), label="SCORER (Ours)",
          note="Table 7 prints BLEU-4 54.3, METEOR 37.5 for the same model"),
        R("scorer_cbr", cc, "changed", f"{SCORER} Table 1", _m(b4=54.4, m=37.6, r=71.7, c=122.4, s=31.6),
          label="SCORER+CBR (Ours)", note="same in Table 7"),
        R("subtraction", cc, "changed", f"{SCORER} Table 7", _m(b4=50.2, m=34.1, r=67.1, c=108.0, s=28.0), label="Subtraction"),
        R("rr", cc, "changed", f"{SCORER} Table 7", _m(b4=53.3, m=37.1, r=70.8, c=119.1, s=30.4), label="RR"),
        R("rr_cbr", cc, "changed", f"{SCORER} Table 7", _m(b4=54.1, m=37.4, r=71.5, c=122.4, s=31.2), label="RR+CBR"),
        R("dirl_ccr", cc, "changed", f"{DIRL} Table 2", _m(b4=54.6, m=38.1, r=71.9, c=123.6, s=31.8), label="DIRL+CCR (Ours)",
          note="captioned 'Comparison with SOTA methods on the CLEVR-Change dataset'; its other rows equal the "
               "changed-pairs-only scores of aux Table 2 and SCORER Table 1 (e.g. DUDA 94.6, SCORER+CBR 122.4), so "
               "read as changed pairs only"),
        # ---------------------------------------------------------------- CLEVR-Change, distractor pairs only
        R("duda", cc, "distractor", f"{AUX} Table 2", _m(b4=59.8, m=45.2, c=110.8, s=29.1), label="DUDA"),
        R("duda_aux", cc, "distractor", f"{AUX} Table 2", _m(b4=62.4, m=50.5, r=53.9, c=116.3, s=35.0), label="Ours"),
        R("subtraction", cc, "distractor", f"{SCORER} Table 7", _m(b4=57.3, m=48.4, r=74.7, c=113.8, s=34.0),
          label="Subtraction (only pseudo change)"),
        R("rr", cc, "distractor", f"{SCORER} Table 7", _m(b4=61.1, m=50.7, r=76.4, c=114.9, s=34.6), label="RR (only pseudo change)"),
        R("scorer", cc, "distractor", f"{SCORER} Table 7", _m(b4=61.4, m=50.6, r=76.5, c=116.4, s=34.7),
          label="SCORER (only pseudo change)"),
        R("rr_cbr", cc, "distractor", f"{SCORER} Table 7", _m(b4=60.7, m=51.2, r=76.9, c=114.9, s=34.6),
          label="RR+CBR (only pseudo change)"),
        R("scorer_cbr", cc, "distractor", f"{SCORER} Table 7", _m(b4=62.0, m=51.7, r=77.4, c=117.9, s=35.0),
          label="SCORER+CBR (only pseudo change)"),
        # ---------------------------------------------------------------- CLEVR-Change, per change type
        R("duda", cc, "by_type", f"{AUX} Table 5 (Distractor: Table 2)",
          _t(color=120.4, texture=86.7, add=108.2, drop=103.4, move=56.4, distractor=110.8), metric="CIDEr", label="DUDA [25]",
          note=f"same in {PCL} Table 3, {SCORER} Table 2 and {CLIP} Table 2"),
        R("duda", cc, "by_type", f"{AUX} Table 5", _t(color=32.8, texture=27.3, add=33.4, drop=31.4, move=23.5), metric="METEOR",
          label="DUDA [25]"),
        R("duda", cc, "by_type", f"{AUX} Table 5", _t(color=21.2, texture=18.3, add=22.4, drop=22.2, move=15.4), metric="SPICE",
          label="DUDA [25]"),
        R("duda_aux", cc, "by_type", f"{AUX} Table 5 (Distractor: Table 2)",
          _t(color=120.8, texture=89.9, add=119.8, drop=123.4, move=62.1, distractor=116.3), metric="CIDEr", label="Ours",
          note=f"same in {CLIP} Table 2"),
        R("duda_aux", cc, "by_type", f"{AUX} Table 5", _t(color=36.1, texture=30.4, add=37.8, drop=36.7, move=27.0), metric="METEOR",
          label="Ours"),
        R("duda_aux", cc, "by_type", f"{AUX} Table 5", _t(color=29.7, texture=27.4, add=31.4, drop=30.8, move=23.5), metric="SPICE",
          label="Ours"),
        R("idc_pcl", cc, "by_type", f"{PCL} Table 3",
          _t(color=131.2, texture=101.1, add=133.3, drop=116.5, move=81.7, distractor=145.0), metric="CIDEr", label="Ours",
          note="the paper's column order is C, T, M, A, D, DI"),
        R("scorer", cc, "by_type", f"{SCORER} Table 2 (Distractor: Table 7)",
          _t(color=143.2, texture=135.2, add=129.4, drop=132.6, move=91.6, distractor=116.4), metric="CIDEr", label="SCORER",
          note="Distractor = Table 7 'only pseudo change' CIDEr"),
        R("scorer_cbr", cc, "by_type", f"{SCORER} Table 2 (Distractor: Table 7)",
          _t(color=146.2, texture=133.7, add=131.1, drop=133.9, move=92.2, distractor=117.9), metric="CIDEr", label="SCORER+CBR",
          note="Distractor = Table 7 'only pseudo change' CIDEr"),
        R("dirl_ccr", cc, "by_type", f"{DIRL} Table 3", _t(color=40.7, texture=38.2, add=40.0, drop=37.9, move=33.5), metric="METEOR",
          label="DIRL+CCR (Ours)", note="DIRL reports per-type METEOR only"),
        R("clip4idc", cc, "by_type", f"{CLIP} Table 2",
          _t(color=149.1, texture=135.3, add=132.4, drop=135.5, move=91.0, distractor=133.4), metric="CIDEr", label="CLIP4IDC",
          note="the paper's column order is C, T, M, A, D, DI"),
        # ---------------------------------------------------------------- CLEVR-DC (whole test split)
        R("duda", dc, "total", f"{SCORER} Table 3", _m(b4=40.3, m=27.1, c=56.7, s=16.1), label="DUDA [22]",
          note=f"same in {DIRL} Table 4"),
        R("scorer", dc, "total", f"{SCORER} Table 3", _m(b4=49.5, m=33.4, c=82.4, s=15.8), label="SCORER"),
        R("scorer_cbr", dc, "total", f"{SCORER} Table 3", _m(b4=49.4, m=33.4, c=83.7, s=16.2), label="SCORER+CBR",
          note=f"{DIRL} Table 4 adds ROUGE-L 66.1"),
        R("dirl_ccr", dc, "total", f"{DIRL} Table 4", _m(b4=51.4, m=32.3, r=66.3, c=84.1, s=16.8), label="DIRL+CCR (Ours)",
          note="same in Table 6 (Transformer + DIRL + CCR; METEOR not in Table 6)"),
        R("transformer", dc, "total", f"{DIRL} Table 6", _m(b4=48.9, r=65.6, c=79.6, s=15.7), label="Transformer"),
        R("dirl", dc, "total", f"{DIRL} Table 6", _m(b4=50.5, r=65.8, c=81.8, s=16.2), label="Transformer + DIRL",
          note="same in Table 7 (non-perturbation + discrimination)"),
        R("transformer_ccr", dc, "total", f"{DIRL} Table 6", _m(b4=49.3, r=65.5, c=82.7, s=16.4), label="Transformer + CCR"),
        R("dirl_nonpert", dc, "total", f"{DIRL} Table 7", _m(b4=50.7, r=65.2, c=79.3, s=16.2), label="DIRL, non-perturbation only"),
        R("dirl_discrim", dc, "total", f"{DIRL} Table 7", _m(b4=50.1, r=65.1, c=79.5, s=16.2), label="DIRL, discrimination only"),
        # ---------------------------------------------------------------- Spot-the-Diff (whole test split)
        # Every pair is changed (no distractors, no change types): no changed / distractor / by_type rows.
        R("duda", sd, "total", f"{AUX} Table 3", _m(b4=8.1, m=11.8, r=29.1, c=32.5), label="DUDA",
          note=f"printed as fractions (0.081, ...); {CLIP} Table 3 prints DUDA (2019) as B 8.1, M 11.5, C 34.0, "
               f"R 28.3, the numbers of the aux Table 3 DDLA row"),
        R("duda_aux", sd, "total", f"{AUX} Table 3", _m(b4=8.1, m=12.5, r=29.9, c=34.5), label="Ours",
          note=f"printed as fractions (0.081, ...); same in {CLIP} Table 3 (DUDA+Aux) and {DIRL} Table 1 (DUDA+TIRG)"),
        R("scorer", sd, "total", f"{SCORER} Table 5 (ROUGE-L: Table 12)", _m(b4=9.4, m=13.8, r=32.0, c=38.5, s=19.3),
          label="SCORER", note="Table 5 has no ROUGE-L column; Table 12 (supplementary ablation) repeats the other four"),
        R("scorer_cbr", sd, "total", f"{SCORER} Table 5 (ROUGE-L: Table 12)", _m(b4=10.2, m=12.2, r=31.9, c=38.9, s=18.4),
          label="SCORER+CBR", note=f"Table 12 repeats the other four; {DIRL} Table 1 prints METEOR 13.2 (and no ROUGE-L)"),
        R("dirl", sd, "total", f"{DIRL}", _m(), label="",
          note="not reported on Spot-the-Diff (Table 1 has DIRL+CCR only)"),
        R("dirl_ccr", sd, "total", f"{DIRL} Table 1", _m(b4=10.3, m=13.8, r=32.8, c=40.9, s=19.9), label="DIRL+CCR (Ours)"),
        R("clip_ft", sd, "total", f"{CLIP} Table 5", _m(b4=11.0, m=12.8, r=33.5, c=43.3), label="CLIP-FT"),
        R("clip4idc_no_adapt", sd, "total", f"{CLIP} Table 5", _m(b4=11.0, m=12.9, r=33.4, c=43.0),
          label="CLIP4IDC without the retrieval adaptation loss"),
        R("clip4idc", sd, "total", f"{CLIP} Table 3", _m(b4=11.6, m=14.2, r=35.0, c=47.4), label="CLIP4IDC",
          note="same in Table 5"),
        # DDLA (Jhamtani & Berg-Kirkpatrick 2018): a paper-only row (no method of this pipeline; a table shows it
        # through `paper_only:`). Its released re-run predictions are scored by workflow/scripts/score_ddla.py.
        R("ddla", sd, "total", f"{AUX} Table 3", _m(b4=8.1, m=11.5, r=28.3, c=34.0), label="DDLA [13]",
          note=f"printed as fractions (0.081, ...); {CLIP} Table 3 prints DDLA (2018) as B 8.5, M 12.0, C 32.8, R 28.6"),
        # ---------------------------------------------------------------- Image Editing Request (whole test split)
        # Every pair is an edit (no distractors, no edit types): no changed / distractor / by_type rows. CLIP4IDC
        # reports B, M, C, R (no SPICE); SCORER's comparison table B, M, R, C (SPICE only in its ablation Table 11);
        # DIRL Table 5 B, M, R, C.
        R("clip_ft", ier, "total", f"{CLIP}", _m(), label="",
          note="not reported on Image Editing Request (Table 5, the only CLIP-FT row, covers CLEVR-Change and "
               "Spot-the-Diff)"),
        R("clip4idc", ier, "total", f"{CLIP} Table 4", _m(b4=8.2, m=14.6, r=40.4, c=32.2), label="CLIP4IDC",
          note="the paper's column order is B, M, C, R"),
        R("scorer", ier, "total", f"{SCORER} Table 4 (SPICE: Table 11)", _m(b4=9.6, m=14.6, r=39.5, c=31.0, s=12.6),
          label="SCORER",
          note="the comparison table between Table 3 (CLEVR-DC) and Table 5 (Spot-the-Diff), its caption lost in the "
               "seed's text, whose §4.4.3 calls it 'Table 11'; the supplementary ablation Table 11 repeats the four "
               "numbers and adds SPICE"),
        R("scorer_cbr", ier, "total", f"{SCORER} Table 4 (SPICE: Table 11)", _m(b4=10.0, m=15.0, r=39.6, c=33.4, s=12.6),
          label="SCORER+CBR",
          note=f"Table 4 read as for SCORER's row; Table 11 repeats the four and adds SPICE; same in {DIRL} Table 5"),
        R("dirl", ier, "total", f"{DIRL}", _m(), label="",
          note="not reported on Image Editing Request (Table 5 has DIRL+CCR only)"),
        R("dirl_ccr", ier, "total", f"{DIRL} Table 5", _m(b4=10.9, m=15.0, r=41.0, c=34.1), label="DIRL+CCR (Ours)"),
        # ---------------------------------------------------------------- Birds-to-Words (whole test split)
        # IDC-PCL Table 1 (B4, M, C(D), R; ROUGE-L the main metric) and Table 5, its cross-task ablation (B2W / CUB /
        # NAB columns). Every pair is changed: no changed / distractor / by_type rows.
        R("idc_pcl_no_pretrain", b2w, "total", f"{PCL}", _m(), label="",
          note="not reported on Birds-to-Words (Table 4, the ablation without pre-training, is on CLEVR-Change)"),
        R("idc_pcl", b2w, "total", f"{PCL} Table 1 (= Table 5, B2W only)", _m(b4=28.0, m=23.1, r=48.4, c=18.6),
          label="Ours"),
        R("idc_pcl_cub", b2w, "total", f"{PCL} Table 5", _m(b4=29.3, m=23.1, r=48.5, c=23.8), label="Ours, B2W + CUB"),
        R("idc_pcl_nabirds", b2w, "total", f"{PCL} Table 5", _m(b4=27.5, m=23.3, r=48.5, c=21.9),
          label="Ours, B2W + NAB"),
        R("idc_pcl_cub_nabirds", b2w, "total", f"{PCL} Table 1 (= Table 5, B2W + CUB + NAB)",
          _m(b4=31.0, m=23.4, r=49.1, c=25.3), label="Ours(+Extra Data)"),
        R("neural_naturalist", b2w, "total", f"{PCL} Table 1", _m(b4=22.0, r=43.0, c=25.0),
          label="Neural Naturalist (2019)"),
        R("relational_speaker", b2w, "total", f"{PCL} Table 1", _m(b4=21.5, m=22.4, r=43.4, c=5.8),
          label="Relational Speaker (2019)"),
        R("duda", b2w, "total", f"{PCL} Table 1", _m(b4=23.9, m=21.9, r=44.3, c=4.6), label="DUDA (2019)"),
        R("l2c", b2w, "total", f"{PCL} Table 1 (= Table 5)", _m(b4=31.3, r=45.3, c=15.1), label="L2C (2021)"),
        R("l2c_cub", b2w, "total", f"{PCL} Table 1 (= Table 5, B2W + CUB)", _m(b4=31.8, r=45.6, c=16.3),
          label="L2C(+CUB) (2021)"),
    ]
    return rows


PAPER_ROWS: tuple[PaperRow, ...] = tuple(_rows())

# Alternative method ids that name the same paper rows.
ALIASES = {"transformer_dirl": "dirl", "transformer_dirl_ccr": "dirl_ccr", "duda_tirg": "duda_aux"}

# Table order: the order of first appearance above.
METHOD_ORDER: tuple[str, ...] = tuple(dict.fromkeys(r.method for r in PAPER_ROWS))


def canonical(method: str) -> str:
    return ALIASES.get(method, method)


def rows(dataset: str, block: str, methods=None, metric: str | None = None) -> list[PaperRow]:
    """Paper rows of one dataset and block (and, for ``by_type``, one metric), in table order.

    ``methods`` restricts (and orders nothing: table order is kept) to those method ids or their aliases.
    """
    if block not in BLOCKS:
        raise ValueError(f"unknown block {block!r}; expected one of {BLOCKS}")
    wanted = None if methods is None else {canonical(m) for m in methods}
    out = [
        r for r in PAPER_ROWS
        if r.dataset == dataset and r.block == block and (metric is None or r.metric == metric)
        and (wanted is None or r.method in wanted)
    ]
    return sorted(out, key=lambda r: METHOD_ORDER.index(r.method))


def lookup(dataset: str, block: str, method: str, metric: str | None = None) -> PaperRow | None:
    found = rows(dataset, block, [method], metric)
    return found[0] if found else None


# ---------------------------------------------------------------- CLIP4IDC adaptation: retrieval, test split
# Image pair -> text ("P2T") and text -> image pair ("T2P"): R@K in %, median / mean rank as printed.
# Run ids are the adaptation runs (`pretraining:` blocks): `clip4idc_adapt` (Table 6) and the Table 7 layer
# splits `clip4idc_adapt_intra{N}_inter{M}` (the adaptation each `clip4idc_frozen_intra{N}_inter{M}` starts from).
# Table 6 reports Spot-the-Diff at R@10/20/50 instead: R@20 and R@50 are further columns, in this order, that a
# retrieval table shows only where one of its paper rows has them (``pipeline.retrieval_tables.table_columns``).
# It reports Image Editing Request at R@1/5/10 without the ranks (MdR, MnR n/a in its paper row).
RETRIEVAL_COLUMNS = ("P2T R@1", "P2T R@5", "P2T R@10", "P2T MdR", "P2T MnR",
                     "T2P R@1", "T2P R@5", "T2P R@10", "T2P MdR", "T2P MnR")
RETRIEVAL_ALL_COLUMNS = ("P2T R@1", "P2T R@5", "P2T R@10", "P2T R@20", "P2T R@50", "P2T MdR", "P2T MnR",
                         "T2P R@1", "T2P R@5", "T2P R@10", "T2P R@20", "T2P R@50", "T2P MdR", "T2P MnR")


@dataclass(frozen=True)
class RetrievalRow:
    run: str
    dataset: str
    source: str
    values: dict[str, float | None]
    label: str = ""
    note: str = ""


def _retrieval_rows() -> list[RetrievalRow]:
    cc = "clevr_change"
    out = [RetrievalRow("clip4idc_adapt", cc, f"{CLIP} Table 6 (MdR, MnR: Table 7)",
                        dict(zip(RETRIEVAL_COLUMNS, (46.4, 83.0, 86.6, 2.0, 39.2, 26.8, 58.7, 70.0, 4.0, 25.6))),
                        label="CLIP4IDC", note="Table 7's N_intra=9, N_inter=3 row prints T2P R@5 as 58.6")]
    for n_intra, n_inter, vals in (
        (6, 6, (46.1, 79.8, 83.9, 2.0, 49.6, 26.4, 57.1, 68.4, 4.0, 29.4)),
        (7, 5, (46.1, 80.8, 84.5, 2.0, 45.5, 27.0, 57.8, 69.0, 4.0, 28.2)),
        (8, 4, (47.2, 80.7, 84.4, 2.0, 46.3, 27.7, 58.7, 69.7, 4.0, 29.9)),
        (9, 3, (46.4, 83.0, 86.6, 2.0, 39.2, 26.8, 58.6, 70.0, 4.0, 25.6)),
        (10, 2, (37.5, 68.5, 73.9, 2.0, 88.8, 22.9, 52.3, 63.9, 5.0, 54.4)),
        (11, 1, (24.7, 47.2, 53.3, 7.0, 143.6, 17.8, 40.2, 50.9, 10.0, 84.8)),
        (12, 0, (2.3, 7.0, 11.8, 182.0, 459.9, 1.1, 3.9, 5.9, 419.0, 716.5)),
    ):
        out.append(RetrievalRow(f"clip4idc_adapt_intra{n_intra}_inter{n_inter}", cc, f"{CLIP} Table 7",
                                dict(zip(RETRIEVAL_COLUMNS, vals)), label=f"N_intra={n_intra}, N_inter={n_inter}"))
    out.append(RetrievalRow("clip4idc_adapt", "spot_the_diff", f"{CLIP} Table 6",
                            dict(zip(("P2T R@10", "P2T R@20", "P2T R@50", "T2P R@10", "T2P R@20", "T2P R@50"),
                                     (3.7, 7.3, 16.8, 6.2, 10.5, 20.0))),
                            label="CLIP4IDC", note="Spot-the-Diff is reported at R@10/20/50 (no R@1/5, no ranks)"))
    out.append(RetrievalRow("clip4idc_adapt", "image_editing_request", f"{CLIP} Table 6",
                            dict(zip(("P2T R@1", "P2T R@5", "P2T R@10", "T2P R@1", "T2P R@5", "T2P R@10"),
                                     (17.1, 28.4, 33.8, 17.3, 33.7, 41.9))),
                            label="CLIP4IDC", note="Editing-Request is reported at R@1/5/10 (no ranks)"))
    return out


RETRIEVAL_ROWS: tuple[RetrievalRow, ...] = tuple(_retrieval_rows())


def retrieval_rows(dataset: str, runs=None) -> list[RetrievalRow]:
    """Retrieval paper rows of a dataset, in the order above, restricted to ``runs`` when given."""
    return [r for r in RETRIEVAL_ROWS if r.dataset == dataset and (runs is None or r.run in runs)]
