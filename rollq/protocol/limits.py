"""The schema version every message carries and the bounds every job is checked against."""

#: Version of every message rollq writes. Bump on any incompatible change.
SCHEMA_VERSION = 1

#: Upper bounds that protect consumers from absurd requests.
MAX_TOKENS_LIMIT = 1 << 20
#: Most tokens one job may ask for over all its samples (``n * max_tokens``): a result of
#: that many tokens with logprobs and text stays well under Redis' 512 MiB bulk limit.
MAX_JOB_TOKENS = 1 << 23
MAX_N = 1024
#: Largest encoded result a replica records (the default of
#: ``ConsumerSettings.max_result_bytes``); a job whose worst-case result is larger
#: (:func:`~rollq.protocol.results.result_bound`) is refused at submission.
MAX_RESULT_BYTES = 64 << 20
MAX_LOGPROBS = 20
MAX_STOP = 64
#: ``meta`` may nest this deep (lists and maps) and take this many bytes encoded: decoding
#: deeper structures recurses, and a consumer must never be made to run out of stack.
MAX_META_DEPTH = 32
MAX_META_BYTES = 1 << 20
