"""Benchmark datasets: prompts of realistic sizes and shapes, generated deterministically.

Rows look like the datasets this project is run on: about 1 KB of prompt text (lognormal, median
~750 characters, capped at 8 KB), 70% a single `prompt`, 20% a `system` + `prompt`, 10% a
ShareGPT `conversations` of three to five turns ending with the human's. The text is drawn from a
Zipf distribution over a fixed English vocabulary plus made-up rarer words, so it compresses
about as ordinary English does (zstd ~2x at 1 KB), which matters for Redis memory.

The 1,000,000-row file (and bench-10m's 10,000,000) is written once and reused (`cached_dataset`), keyed by its parameters.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from itertools import accumulate
from pathlib import Path

COMMON = """the of and to a in is it you that he was for on are with as I his they be at one have
this from or had by hot word but what some we can out other were all there when up use your how
said an each she which do their time if will way about many then them write would like so these
her long make thing see him two has look more day could go come did number sound no most people my
over know water than call first who may down side been now find any new work part take get place
made live where after back little only round man year came show every good me give our under name
very through just form sentence great think say help low line differ turn cause much mean before
move right boy old too same tell does set three want air well also play small end put home read
hand port large spell add even land here must big high such follow act why ask men change went
light kind off need house picture try us again animal point mother world near build self earth
father head stand own page should country found answer school grow study still learn plant cover
food sun four between state keep eye never last let thought city tree cross farm hard start might
story saw far sea draw left late run while press close night real life few north open seem
together next white children begin got walk example ease paper group always music those both mark
often letter until mile river car feet care second book carry took science eat room friend began
idea fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl
usual young ready above ever red list though feel talk bird soon body dog family direct pose leave
song measure door product black short numeral class wind question happen complete ship area half
rock order fire south problem piece told knew pass since top whole king space heard best hour
better true during hundred five remember step early hold west ground interest reach fast verb
sing listen six table travel less morning ten simple several vowel toward war lay against pattern
slow center love person money serve appear road map rain rule govern pull cold notice voice unit
power town fine certain fly fall lead cry dark machine note wait plan figure star box noun field
rest correct able pound done beauty drive stood contain front teach week final gave green oh quick
develop ocean warm free minute strong special mind behind clear tail produce fact street inch
multiply nothing course stay wheel full force blue object decide surface deep moon island foot
system busy test record boat common gold possible plane stead dry wonder laugh thousand ago ran
check game shape equate miss brought heat snow tire bring yes distant fill east paint language
among grand ball yet wave drop heart am present heavy dance engine position arm wide sail material
size vary settle speak weight general ice matter circle pair include divide syllable felt perhaps
pick sudden count square reason length represent art subject region energy hunt probable bed
brother egg ride cell believe fraction forest sit race window store summer train sleep prove lone
leg exercise wall catch mount wish sky board joy winter sat written wild instrument kept glass
grass cow job edge sign visit past soft fun bright gas weather month million bear finish happy
hope flower clothe strange gone jump baby eight village meet root buy raise solve metal whether
push seven paragraph third shall held hair describe cook floor either result burn hill safe cat
century consider type law bit coast copy phrase silent tall sand soil roll temperature finger
industry value fight lie beat excite natural view sense ear else quite broke case middle kill son
lake moment scale loud spring observe child straight consonant nation dictionary milk speed method
organ pay age section dress cloud surprise quiet stone tiny climb cool design poor lot experiment
bottom key iron single stick flat twenty skin smile crease hole trade melody trip office receive
row mouth exact symbol die least trouble shout except wrote seed tone join suggest clean break lady
yard rise bad blow oil blood touch grew cent mix team wire cost lost brown wear garden equal sent
choose fell fit flow fair bank collect save control decimal gentle woman captain practice separate
difficult doctor please protect noon whose locate ring character insect caught period indicate
radio spoke atom human history effect electric expect crop modern element hit student corner party
supply bone rail imagine provide agree thus capital chair danger fruit rich thick soldier process
operate guess necessary sharp wing create neighbor wash bat rather crowd corn compare poem string
bell depend meat rub tube famous dollar stream fear sight thin triangle planet hurry chief colony
clock mine tie enter major fresh search send yellow gun allow print dead spot desert suit current
lift rose continue block chart hat sell success company subtract event particular deal swim term
opposite wife shoe shoulder spread arrange camp invent cotton born determine quart nine truck noise
level chance gather shop stretch throw shine property column molecule select wrong gray repeat
require broad prepare salt nose plural anger claim continent oxygen sugar death pretty skill women
season solution magnet silver thank branch match suffix especially fig afraid huge sister steel
discuss forward similar guide experience score apple bought led pitch coat mass card band rope slip
win dream evening condition feed tool total basic smell valley nor double seat arrive master track
parent shore division sheet substance favor connect post spend chord fat glad original share
station dad bread charge proper bar offer segment slave duck instant market degree populate chick
dear enemy reply drink occur support speech nature range steam motion path liquid log meant
quotient teeth shell neck function code python explain prove derive theorem matrix vector integer
compute algorithm implement recursive array string parse return error database query server client
network request response model train dataset loss gradient token prompt""".split()
_SYLLABLES = "ka lo mi ne ru sa ti vo ba de fi gu ho ja ke li mo nu pa qui re so tu ve wa xe yo za".split()
_PUNCT = [".", ".", ".", ",", ",", ",", "?", ":", ";"]


def _vocabulary(rng: random.Random) -> tuple[list[str], list[float]]:
    rare = {"".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(20000)}
    words = COMMON + sorted(rare - set(COMMON))
    weights = [1.0 / (rank + 1) ** 1.07 for rank in range(len(words))]
    return words, list(accumulate(weights))


def text_pool(seed: int = 7, words: int = 3_000_000) -> str:
    """A long run of Zipf-distributed words with sentence punctuation; prompts are slices of it."""
    rng = random.Random(seed)
    vocab, cum = _vocabulary(rng)
    drawn = rng.choices(vocab, cum_weights=cum, k=words)
    out = []
    for i, w in enumerate(drawn):
        out.append(w)
        if i % 13 == 12:
            out.append(rng.choice(_PUNCT))
    return " ".join(out).replace(" .", ".").replace(" ,", ",").replace(" ?", "?").replace(" :", ":").replace(" ;", ";")


class PromptMaker:
    """Row i of the benchmark dataset, deterministic in (seed, i)."""

    def __init__(self, seed: int = 7):
        self.pool = text_pool(seed)
        self.seed = seed

    def _text(self, rng: random.Random, median: float) -> str:
        n = min(8000, max(20, int(median * math.exp(0.75 * rng.gauss(0, 1)))))
        start = rng.randrange(0, len(self.pool) - n - 1)
        return self.pool[start:start + n].strip().capitalize() or "Explain."

    def row(self, i: int) -> dict:
        rng = random.Random(self.seed * 1_000_003 + i)
        kind = rng.random()
        row: dict = {"id": f"bench-{i:07d}"}
        if kind < 0.70:
            row["prompt"] = self._text(rng, 750)
        elif kind < 0.90:
            row["system"] = self._text(rng, 180)
            row["prompt"] = self._text(rng, 600)
        else:
            turns = rng.choice((3, 5))
            row["conversations"] = [
                {"from": "human" if t % 2 == 0 else "gpt", "value": self._text(rng, 260)}
                for t in range(turns)]
        return row


def _write_rows(path: Path, start: int, stop: int, seed: int) -> None:
    maker = PromptMaker(seed)
    dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
    with open(path, "w", encoding="utf-8", buffering=1 << 20) as f:
        for i in range(start, stop):
            f.write(dumps(maker.row(i)))
            f.write("\n")


def write_dataset(path: Path, n: int, seed: int = 7) -> Path:
    """Write n rows as JSONL (atomically: a temporary file, then a rename). Rows are made in
    shards, one process per core (10 million rows take minutes on one), then concatenated."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    os.close(fd)
    workers = max(1, min(os.cpu_count() or 1, n // 100_000))
    bounds = [n * w // workers for w in range(workers + 1)]
    shards = [Path(f"{tmp}.{w}") for w in range(workers)]
    try:
        with ProcessPoolExecutor(workers) as pool:
            for done in [pool.submit(_write_rows, shard, bounds[w], bounds[w + 1], seed)
                         for w, shard in enumerate(shards)]:
                done.result()
        with open(tmp, "wb") as out:
            for shard in shards:
                with open(shard, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
                shard.unlink()
        os.replace(tmp, path)
    finally:
        for leftover in (*shards, Path(tmp)):
            leftover.unlink(missing_ok=True)
    return path


def cached_dataset(n: int, cache_dir: Path, seed: int = 7) -> Path:
    """The n-row dataset, generated on first use and kept in cache_dir for later runs."""
    path = cache_dir / f"prompts-{n}-s{seed}-v1.jsonl"
    if not path.exists():
        write_dataset(path, n, seed)
    return path
