from gyre.cli import app

if __name__ == "__main__":  # multiprocessing's forkserver (evaluator sandboxes) imports the main module again
    app()
