"""The engine inspector's outside: the ``/inspect`` page and its endpoints (`app.inspector.web`), traces that
replay it offline (`app.inspector.trace`), and the page itself (``index.html``, ``inspector.js``,
``inspector.css``: plain files, no build step). The recording lives in the engine: `core.inspector`."""
