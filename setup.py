"""Wheel builds compile the .proto files into server/rpc/gen (see server/rpc/codegen.py)."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithProtos(build_py):
    def run(self):
        here = Path(__file__).resolve().parent
        for name in ("search.proto", "shard.proto"):
            shutil.copy2(here / "proto" / name, here / "server" / "rpc" / name)
        from server.rpc.codegen import generate

        generate()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
