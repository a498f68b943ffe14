from typing import Any

HTTP: int
UNARY: int
STREAM_OPEN: int
STREAM_MESSAGE: int
STREAM_END: int
CANCEL: int
CREDIT: int
TROUBLE: int
TROUBLE_SLOW: int
TROUBLE_EVICTED: int
TROUBLE_ACCEPT: int
TROUBLE_TURNED_AWAY: int

class Frontend:
    def __init__(self, threads: int = 2) -> None: ...
    @property
    def wake_fd(self) -> int: ...
    def listen_http(
        self,
        host: str,
        port: int,
        *,
        max_body: int,
        body_timeout: float,
        body_min_rate: float,
        header_timeout: float,
        keep_alive: float,
        max_connections: int,
        reuse_port: bool = False,
    ) -> int: ...
    def listen_grpc(
        self, host: str, port: int, *, max_message: int, reuse_port: bool = False
    ) -> int: ...
    def take(self) -> list[tuple[Any, ...]]: ...
    def respond(
        self, id: int, status: int, headers: list[tuple[bytes, bytes]], body: Any
    ) -> bool: ...
    def respond_stream(self, id: int, status: int, headers: list[tuple[bytes, bytes]]) -> bool: ...
    def reply(self, id: int, code: int, message: str, body: Any = None) -> bool: ...
    def stream_send(self, id: int, message: Any) -> bool: ...
    def stream_read(self, id: int, count: int) -> None: ...
    def stream_close(self, id: int, code: int, message: str) -> bool: ...
    def stop_accepting(self) -> None: ...
    def close(self, timeout: float = 1.0) -> None: ...
