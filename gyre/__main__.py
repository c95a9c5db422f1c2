from gyre.cli import app

app()
