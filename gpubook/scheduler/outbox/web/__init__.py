"""The read-only status web page (Flask + Jinja2, served by waitress): app.py the app, page.py what
one viewer sees, access.py who may see it, live.py NVML's reading, serve.py the server thread.
Imported only where the page is served (Flask stays out of a daemon that does not serve it)."""
