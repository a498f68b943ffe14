"""One log line of each severity per request, through Triton's pb_utils.Logger."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        logger = pb_utils.Logger
        responses = []
        for request in requests:
            tag = pb_utils.get_input_tensor_by_name(request, "TAG").as_numpy()[0].decode()
            logger.log(f"{tag} specific line", logger.INFO)
            logger.log_info(f"{tag} info line")
            logger.log_warn(f"{tag} warning line")
            logger.log_error(f"{tag} error line")
            logger.log_verbose(f"{tag} verbose line")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", [tag.encode()])]))
        return responses
