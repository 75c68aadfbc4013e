"""Search and recall over a tenant's memories (services layer).

* :mod:`memories.search.text` — tokenizer: what a memory is found by, what a question asks for.
* :mod:`memories.search.index` — what a write stores, the backfill, the term statistics.
* :mod:`memories.search.lexical` — bounded candidate retrieval and BM25-style ranking:
  :func:`lexical_candidates` → ``[(memory id, score)]``.
* :mod:`memories.search.ranking` — the one place results are assembled:
  :func:`search_ranked` (candidate lists → fused order → Memory rows) and
  :func:`recall_pack` (prefix-only salience, near-duplicates dropped, budget packed).
  Another ranker (e.g. embeddings) joins there, as one more candidate list to fuse.
"""

from memories.search.index import index_fields
from memories.search.lexical import CANDIDATES, SearchTimeout, lexical_candidates
from memories.search.ranking import recall_pack, search_ranked, search_ranked_ids
from memories.search.text import compact, index_document, query_words, tokenize, value_text

__all__ = [
    "CANDIDATES",
    "SearchTimeout",
    "compact",
    "index_document",
    "index_fields",
    "lexical_candidates",
    "query_words",
    "recall_pack",
    "search_ranked",
    "search_ranked_ids",
    "tokenize",
    "value_text",
]
