"""Imported at start-up by every Python process of tools/sanitized_tests.sh
(it puts this folder on PYTHONPATH): sends UBSan's reports to files.

gcc's ASan and UBSan runtimes are two libraries that both export
__sanitizer_set_report_path. UBSan's start-up call resolves to ASan's copy
(preloaded first), so UBSAN_OPTIONS=log_path moves ASan's reports and leaves
UBSan's on stderr, where a test's captured output can hide them. Calling
UBSan's own copy fixes that.
"""

import ctypes
import os

_path = os.environ.get("DDP_EXT_UBSAN_LOG_PATH")
if _path:
    ctypes.CDLL("libubsan.so.1").__sanitizer_set_report_path(_path.encode())
