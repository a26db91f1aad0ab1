"""Build hook for the ``cilia-api`` package.

The Python modules are generated from the ``.proto`` files under this
directory by ``grpc_tools.protoc`` when the package is built (wheel or
install); generated code is never committed. Imports follow the proto
package: ``cilia.agent.v1.agent_pb2``, ``cilia.controlplane.v1.controlplane_pb2``.
"""

from __future__ import annotations

import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent


def proto_files() -> list[pathlib.Path]:
    """Every .proto under this directory, excluding build output."""
    return sorted(
        p for p in HERE.glob("cilia/**/*.proto") if "build" not in p.relative_to(HERE).parts
    )


class GenerateProtos(build_py):
    """Run protoc (messages, typing stubs, gRPC stubs) into the build dir."""

    def run(self) -> None:
        from grpc_tools import protoc  # build-time dependency only

        out = pathlib.Path(self.build_lib)
        out.mkdir(parents=True, exist_ok=True)
        include = pathlib.Path(protoc.__file__).parent / "_proto"
        files = [str(p.relative_to(HERE)) for p in proto_files()]
        args = [
            "grpc_tools.protoc",
            f"-I{HERE}",
            f"-I{include}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *files,
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed for {files}")
        for gen in list(out.glob("cilia/**/*.py")):
            for parent in gen.relative_to(out).parents:
                if parent == pathlib.Path("."):
                    continue
                (out / parent / "__init__.py").touch()
        (out / "cilia" / "py.typed").touch()
        super().run()


def generated_packages() -> list[str]:
    """Python packages the generated modules live in (one per proto dir)."""
    pkgs: set[str] = set()
    for proto in proto_files():
        rel = proto.parent.relative_to(HERE)
        for i in range(1, len(rel.parts) + 1):
            pkgs.add(".".join(rel.parts[:i]))
    return sorted(pkgs)


setup(
    packages=generated_packages(),
    package_data={"cilia": ["py.typed"], "": ["*.pyi"]},
    cmdclass={"build_py": GenerateProtos},
)
