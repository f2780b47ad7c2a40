"""The chat page at the server's root: a few static files shipped in the package (plain HTML, CSS
and JavaScript, no build step), talking to this server's own API.

The files are read once, when the app is built (a missing file fails at start-up, not per
request). They need no API key -- the page asks for it and sends it to the API -- and come with a
Content-Security-Policy that lets the page run only its own script file and reach only this
server, so that nothing a model writes can run even if it ever reached the page as HTML."""
from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

STATIC = Path(__file__).with_name("static")

#: URL path -> (file in STATIC, media type)
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
    "/ui/favicon.svg": ("favicon.svg", "image/svg+xml"),
}

#: no inline script or style, no eval, no outside origin: pictures and recordings the user attaches
#: are previewed from data: / blob: URLs made in the page
CSP = "; ".join([
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data: blob:",
    "media-src 'self' data: blob:",
    "connect-src 'self'",
    "font-src 'self'",
    "object-src 'none'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


def ui_routes() -> list[Route]:
    """GET routes for the page's files."""
    routes = []
    for path, (name, media_type) in FILES.items():
        body = (STATIC / name).read_bytes()

        async def endpoint(request: Request, body: bytes = body, media_type: str = media_type) -> Response:
            return Response(body, media_type=media_type, headers=HEADERS)

        routes.append(Route(path, endpoint, methods=["GET", "HEAD"]))
    return routes
