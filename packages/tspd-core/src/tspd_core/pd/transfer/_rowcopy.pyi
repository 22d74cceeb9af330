"""Type stub of the native row copies (``_rowcopy.pyx``, used by ``byterows``)."""

STREAMS: bool

def copy_strided(
    dst: int, dst_step: int, src: int, src_step: int, count: int, length: int, stream: bool
) -> None: ...
def copy_rows(dst: int, rows: int, src: int, count: int, size: int, stream: bool) -> None: ...
